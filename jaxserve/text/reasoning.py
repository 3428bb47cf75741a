"""Reasoning parsers: a thinking model's output split into its reasoning and its answer (``--reasoning-parser``,
vLLM's names and rules), whole or as it streams.

Families (vLLM's names):

- ``deepseek_r1``: ``<think>`` … ``</think>``; the template opens the block in the prompt, so the output starts
  in reasoning (a ``<think>`` the model writes itself is dropped); no ``</think>``: all of it is reasoning;
- ``deepseek_v3``: ``deepseek_r1``'s rules when ``chat_template_kwargs`` sets ``thinking`` (or
  ``enable_thinking``), else no reasoning at all (DeepSeek-V3.1's template thinks only when asked);
- ``qwen3``: ``<think>`` … ``</think>``, starting in reasoning unless ``enable_thinking`` is false; a
  ``<tool_call>`` ends the reasoning too;
- ``glm45``: as ``qwen3`` (``thinking`` or ``enable_thinking`` false turns it off);
- ``kimi_k2``: as ``qwen3`` with ``thinking`` / ``enable_thinking``; the tool-call section ends the reasoning;
- ``mistral``: ``[THINK]`` … ``[/THINK]`` (Magistral), starting in content: reasoning only where the model opens
  a block before any answer;
- ``openai_gptoss``: gpt-oss's harmony channels: the ``analysis`` channel is reasoning, the ``final`` channel the
  answer (``<|channel|>NAME<|message|>TEXT<|end|>``); commentary-channel tool calls are left to the ``openai``
  tool parser.

The markers are held back while they may still be arriving, so each streamed piece is final. Host-only: imports
nothing of the engine or the server.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxserve.sampling_params import SamplingParams

REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "glm45", "kimi_k2", "mistral", "openai_gptoss", "qwen3")


@dataclasses.dataclass
class ReasoningDelta:
    """What a piece of output adds to the reasoning and to the answer."""

    reasoning: str = ""
    content: str = ""


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``markers``."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


def _flag(kwargs: dict, *names: str, default: bool) -> bool:
    """vLLM's reading of the thinking switches: the default unless one of ``names`` is set, then any of them."""
    given = [kwargs.get(n) for n in names if kwargs.get(n) is not None]
    return default if not given else any(bool(v) for v in given)


class ReasoningParser:
    """One family's rules; ``stream()`` gives the splitter of one output. ``thinking``: the request's template
    switches (``chat_template_kwargs``) leave the reasoning on."""

    name = ""
    start, end = "<think>", "</think>"
    implicit_ends: tuple[str, ...] = ()  # markers that end the reasoning and stay in the answer (a tool call)
    starts_in_reasoning = True

    def __init__(self, chat_template_kwargs: dict[str, Any] | None = None):
        self.thinking = self._thinking(chat_template_kwargs or {})

    def _thinking(self, kwargs: dict) -> bool:
        return True

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output, None where there is none."""
        s = self.stream()
        d, e = s.feed(text), s.finish()
        reasoning, content = d.reasoning + e.reasoning, d.content + e.content
        return (reasoning if s.reasoned else None), (content or None)


class ReasoningStream:
    """One output's split as it streams: ``feed(piece)`` gives what is sure so far, ``finish()`` the rest."""

    def __init__(self, parser: ReasoningParser):
        self.p = parser
        self.buf = ""
        self.state = "reasoning" if parser.thinking and parser.starts_in_reasoning else "content"
        self.reasoned = self.state == "reasoning"  # a reasoning block was opened
        self.at_start = True  # nothing given out yet in the current state

    def feed(self, piece: str) -> ReasoningDelta:
        self.buf += piece
        out = ReasoningDelta()
        p = self.p
        while self.buf:
            if self.state == "reasoning":
                if self.at_start:  # a start marker the model writes itself (after blank space) is dropped
                    lead = self.buf.lstrip()
                    if lead.startswith(p.start):
                        self.buf = lead[len(p.start):]
                        self.at_start = False
                        continue
                    if p.start.startswith(lead):
                        break  # maybe a start marker still arriving
                ends = [(i, m) for m in (p.end, *p.implicit_ends) if (i := self.buf.find(m)) >= 0]
                if ends:
                    i, m = min(ends)
                    out.reasoning += self.buf[:i]
                    self.buf = self.buf[i + len(p.end):] if m == p.end else self.buf[i:]
                    self.state, self.at_start = "content", True
                    continue
                keep = held_back(self.buf, (p.start, p.end, *p.implicit_ends) if self.at_start
                             else (p.end, *p.implicit_ends))
                out.reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                self.at_start = self.at_start and not out.reasoning.strip()
                break
            # content: a reasoning block may open before any answer (a family that starts in content)
            if self.p.thinking and not self.reasoned and self.at_start:
                lead = self.buf.lstrip()
                if lead.startswith(p.start):
                    self.buf = lead[len(p.start):]
                    self.state, self.reasoned, self.at_start = "reasoning", True, False
                    continue
                if p.start.startswith(lead):
                    break
            out.content += self.buf
            self.buf = ""
            self.at_start = False
        return out

    def finish(self) -> ReasoningDelta:
        rest, self.buf = self.buf, ""
        if self.state == "reasoning":
            return ReasoningDelta(reasoning=rest.lstrip() if self.at_start else rest)
        return ReasoningDelta(content=rest)


class DeepSeekR1(ReasoningParser):
    name = "deepseek_r1"


class DeepSeekV3(ReasoningParser):
    name = "deepseek_v3"

    def _thinking(self, kwargs):
        return _flag(kwargs, "thinking", "enable_thinking", default=False)


class Qwen3(ReasoningParser):
    name = "qwen3"
    implicit_ends = ("<tool_call>",)

    def _thinking(self, kwargs):
        return _flag(kwargs, "enable_thinking", default=True)


class Glm45(ReasoningParser):
    name = "glm45"
    implicit_ends = ("<tool_call>",)

    def _thinking(self, kwargs):
        return _flag(kwargs, "thinking", "enable_thinking", default=True)


class KimiK2(ReasoningParser):
    name = "kimi_k2"
    implicit_ends = ("<|tool_calls_section_begin|>",)

    def _thinking(self, kwargs):
        return _flag(kwargs, "thinking", "enable_thinking", default=True)


class Mistral(ReasoningParser):
    name = "mistral"
    start, end = "[THINK]", "[/THINK]"
    starts_in_reasoning = False


# gpt-oss (harmony) -----------------------------------------------------------------------------------------------
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
_HEADER = re.compile(r"(?:<\|start\|>(?P<role>[^<]*))?(?:<\|channel\|>(?P<channel>[^<]*))?"
                     r"(?:<\|constrain\|>(?P<constrain>[^<]*))?<\|message\|>")


@dataclasses.dataclass
class HarmonyMessage:
    """One message of a harmony output: its channel, its header (``to=functions.NAME`` for a call) and text."""

    channel: str
    header: str
    text: str = ""
    closed: bool = False  # its end (``<|end|>``, ``<|call|>``, ``<|return|>``) has been read

    @property
    def recipient(self) -> str | None:
        m = re.search(r"to=(\S+)", self.header)
        return m.group(1) if m else None


class HarmonyStream:
    """A gpt-oss output read message by message as it streams: ``feed`` gives the messages it touched (the last
    one may still be open), each message's ``text`` only what is sure."""

    def __init__(self):
        self.buf = ""
        self.messages: list[HarmonyMessage] = []

    @property
    def open(self) -> HarmonyMessage | None:
        return self.messages[-1] if self.messages and not self.messages[-1].closed else None

    def feed(self, piece: str) -> list[tuple[HarmonyMessage, str]]:
        """(message, text it gained) for each message the piece reached."""
        self.buf += piece
        out: list[tuple[HarmonyMessage, str]] = []
        while self.buf:
            msg = self.open
            if msg is None:
                m = _HEADER.search(self.buf)
                if m is None:
                    break  # a header still arriving
                channel = (m.group("channel") or "final").split() or ["final"]
                msg = HarmonyMessage(channel[0], m.group(0))
                self.messages.append(msg)
                self.buf = self.buf[m.end():]
                out.append((msg, ""))
                continue
            ends = [(i, t) for t in ("<|end|>", "<|call|>", "<|return|>") if (i := self.buf.find(t)) >= 0]
            if ends:
                i, t = min(ends)
                self._give(out, msg, self.buf[:i])
                msg.closed = True
                self.buf = self.buf[i + len(t):]
                continue
            keep = held_back(self.buf, HARMONY_TOKENS)
            self._give(out, msg, self.buf[: len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out

    @staticmethod
    def _give(out, msg: HarmonyMessage, text: str) -> None:
        msg.text += text
        if out and out[-1][0] is msg:
            out[-1] = (msg, out[-1][1] + text)
        else:
            out.append((msg, text))

    def finish(self) -> list[tuple[HarmonyMessage, str]]:
        """The rest: text of the open message (the output was cut short), or text outside any message, as the
        answer (a model that wrote no harmony header)."""
        rest, self.buf = self.buf, ""
        msg = self.open
        if msg is None:
            if not rest:
                return []
            msg = HarmonyMessage("final", "")
            self.messages.append(msg)
        msg.text += rest
        return [(msg, rest)]


class GptOss(ReasoningParser):
    """Harmony's channels: analysis is reasoning; final (and plain commentary without a recipient, gpt-oss's
    preambles) the answer."""

    name = "openai_gptoss"

    def stream(self) -> GptOssStream:
        return GptOssStream()

    def split(self, text):
        s = self.stream()
        d, e = s.feed(text), s.finish()
        reasoning, content = d.reasoning + e.reasoning, d.content + e.content
        return (reasoning if s.reasoned else None), (content or None)


def harmony_delta(pieces: list[tuple[HarmonyMessage, str]]) -> tuple[ReasoningDelta, bool]:
    """What ``HarmonyStream`` pieces add to the reasoning (the analysis channel) and to the answer (messages to no
    recipient), and whether any of them was reasoning."""
    out, reasoned = ReasoningDelta(), False
    for msg, text in pieces:
        if msg.channel == "analysis":
            reasoned = True
            out.reasoning += text
        elif msg.recipient is None:
            out.content += text
    return out, reasoned


class GptOssStream:
    def __init__(self):
        self.harmony = HarmonyStream()
        self.reasoned = False

    def _delta(self, pieces) -> ReasoningDelta:
        out, reasoned = harmony_delta(pieces)
        self.reasoned = self.reasoned or reasoned
        return out

    def feed(self, piece: str) -> ReasoningDelta:
        return self._delta(self.harmony.feed(piece))

    def finish(self) -> ReasoningDelta:
        return self._delta(self.harmony.finish())


PARSERS = {p.name: p for p in (DeepSeekR1, DeepSeekV3, Glm45, GptOss, KimiK2, Mistral, Qwen3)}


def check_reasoning_parser(name: str | None) -> None:
    """ValueError naming ``reasoning_parser`` for a name that is not one of ``REASONING_PARSERS``."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"reasoning_parser={name!r} must be one of {', '.join(REASONING_PARSERS)}")


def make_reasoning_parser(name: str | None, chat_template_kwargs: dict | None = None) -> ReasoningParser | None:
    """The parser ``name`` for one request (its template switches), None for no name."""
    check_reasoning_parser(name)
    return None if name is None else PARSERS[name](chat_template_kwargs)


def reasoning_first(params: SamplingParams, reasoning: ReasoningParser | None,
                    in_reasoning: bool = False) -> SamplingParams:
    """``params`` with its structured output held back until the reasoning ends (``reasoning_end``), as vLLM
    applies it: when the request has a constraint and the output starts in reasoning (the family's template opens
    the block and thinking is on). ``in_reasoning`` (``--structured-outputs-config`` enable_in_reasoning) keeps
    the constraint from the first token. gpt-oss's harmony channels are not watched: its constraint starts at once.
    """
    if (in_reasoning or params.structured_outputs is None or reasoning is None or isinstance(reasoning, GptOss)
            or not (reasoning.thinking and reasoning.starts_in_reasoning)):
        return params
    return dataclasses.replace(params, reasoning_end=reasoning.end)
