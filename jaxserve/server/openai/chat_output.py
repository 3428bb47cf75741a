"""One choice's output as the chat API answers it: the reasoning split off (``--reasoning-parser``), the tool
calls read (``--tool-call-parser`` or a forced ``tool_choice``) from the answer after the reasoning, and the rest
as content; fed piece by piece for a streamed answer (each piece's ``OutputDelta``), or whole.

gpt-oss (the ``openai_gptoss`` reasoning parser or the ``openai`` tool parser) is read by its harmony channels:
the analysis channel is the reasoning, messages to ``functions.NAME`` are the calls, the rest is content.

The endpoint modules share it: each turns the deltas and the totals into its own API's shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.server.openai.tool_calls import ToolCall, ToolCallStream
from jaxserve.server.openai.tool_parsers import PartialCall
from jaxserve.text.reasoning import GptOss, HarmonyStream, ReasoningParser, harmony_delta


@dataclasses.dataclass
class OutputDelta:
    """What a piece of output adds: content, reasoning, and vLLM's streamed tool-call deltas."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class ChoiceOutput:
    """The parsers of one choice. ``reasoning``: the request's reasoning parser (None: no split); ``tools``: its
    tool-call stream (None: calls are not read)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallStream | None):
        self.tools = tools
        harmony = isinstance(reasoning, GptOss) or (tools is not None and tools.parser is not None
                                                    and tools.parser.harmony)
        self.harmony = HarmonyStream() if harmony else None
        self.reasoning_stream = reasoning.stream() if reasoning is not None and not harmony else None
        self.content, self.reasoning = "", ""
        self.reasoned = False

    def feed(self, text: str) -> OutputDelta:
        if self.harmony is not None:
            return self._harmony(self.harmony.feed(text), False)
        return self._answer(self.reasoning_stream.feed(text) if self.reasoning_stream is not None else None, text,
                            False)

    def finish(self) -> OutputDelta:
        if self.harmony is not None:
            return self._harmony(self.harmony.finish(), True)
        return self._answer(self.reasoning_stream.finish() if self.reasoning_stream is not None else None, "",
                            True)

    def _answer(self, split, text: str, final: bool) -> OutputDelta:
        out = OutputDelta()
        if split is not None:
            out.reasoning, text = split.reasoning, split.content
            self.reasoned = self.reasoning_stream.reasoned
        if self.tools is not None:
            self._read_calls(out, text, final)
        else:
            out.content = text
        self._count(out)
        return out

    def _read_calls(self, out: OutputDelta, text: str, final: bool) -> None:
        """The answer's ``text`` through the tool-call stream: the content before the calls and the calls."""
        out.content, out.tool_calls = self.tools.feed(text)
        if final:
            rest, calls = self.tools.finish()
            out.content += rest
            out.tool_calls += calls

    def _harmony(self, pieces, final: bool) -> OutputDelta:
        split, reasoned = harmony_delta(pieces)
        self.reasoned = self.reasoned or reasoned
        out = OutputDelta(content=split.content, reasoning=split.reasoning)
        reads_calls = self.tools is not None and self.tools.parser is not None and self.tools.parser.harmony
        if self.tools is not None and not reads_calls:  # a forced tool_choice: the answer is the calls' JSON
            self._read_calls(out, out.content, final)
        elif reads_calls:
            partial = [PartialCall(m.recipient.removeprefix("functions."), m.text.strip(), m.closed)
                       for m in self.harmony.messages if m.recipient is not None
                       and m.recipient.startswith("functions.")]
            out.tool_calls = self.tools.deltas(partial)
            if final:  # gpt-oss's <|call|> is a stop token: a call's end is the output's
                self.tools.calls = [ToolCall(c.name, c.arguments, self.tools.ids[k]) for k, c in enumerate(partial)]
        self._count(out)
        return out

    def _count(self, out: OutputDelta) -> None:
        self.content += out.content
        self.reasoning += out.reasoning

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    def message(self, include_reasoning: bool = True, role: str = "assistant") -> dict[str, Any]:
        """The choice's whole ``message`` (after ``finish``): vLLM's ``reasoning`` beside the content, and the
        calls with the content before them (None if empty) when there are calls."""
        message: dict[str, Any] = {"role": role, "content": self.content}
        if self.calls:
            message["content"] = self.content.strip() or None
            message["tool_calls"] = [c.to_openai() for c in self.calls]
        elif self.reasoning_stream is not None or self.harmony is not None:
            message["content"] = self.content or None
        if include_reasoning and self.reasoned:
            message["reasoning"] = self.reasoning
        return message
