"""Tool-call parsers (``--tool-call-parser``): the calls a model writes, in its family's format, turned into
OpenAI ``tool_calls``, whole or as they stream (vLLM's names and formats).

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around them is content;
- ``llama3_json``: a JSON object ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after
  ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name": ..., "arguments": {...}}``;
- ``qwen3_coder``: Qwen3-Coder / Qwen3.5's XML, ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>
  </function></tool_call>``; values typed by the tool's JSON schema (text for strings);
- ``glm45``: ``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>``, values as
  ``qwen3_coder``'s;
- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` then the arguments
  in a fenced ```` ```json ```` block, ``<｜tool▁call▁end｜>``;
- ``deepseek_v31``: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>``;
- ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
  ARGUMENTS<|tool_call_end|>``; the call's id is Kimi's own ``functions.NAME:0``;
- ``pythonic``: Llama 4's Python list of calls, ``[get_weather(city='Oslo'), get_time()]``, optionally inside
  ``<|python_start|>`` … ``<|python_end|>``;
- ``openai``: gpt-oss's harmony messages to ``functions.NAME`` in the commentary channel (read with the output's
  channels by ``chat_output``).

Streaming: content goes out until a call's start marker; a call goes out as vLLM streams it, first its id, type
and name, then its arguments in fragments as they are written (formats that write JSON arguments), or as soon
as each argument is complete (the XML formats). ``hermes``, ``llama3_json``, ``mistral`` and ``pythonic`` send
each call whole when the output ends.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
from typing import Any

from jaxserve.text.reasoning import HarmonyStream, held_back

TOOL_CALL_PARSERS = ("deepseek_v3", "deepseek_v31", "glm45", "hermes", "kimi_k2", "llama3_json", "mistral", "openai",
                     "pythonic", "qwen3_coder")


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


def _call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


@dataclasses.dataclass
class PartialCall:
    """A call as far as the output has written it: ``arguments`` only ever grows (each streamed fragment is
    final), ``done`` once its end marker has been read."""

    name: str
    arguments: str = ""
    done: bool = False
    id: str | None = None  # the model's own call id (Kimi K2's), else one is made


class ToolParser:
    """Splits a finished output into (content, tool calls) (``parse``); ``content_end`` is where a streamed output
    stops being content; ``scan`` reads the calls of an output so far, for streaming them as they are written.
    ``tools``: the request's, for typing the arguments of formats that write them as text (XML)."""

    name = ""
    start_marker = ""
    harmony = False  # gpt-oss: the calls are harmony messages, read with the output's channels

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[ToolCall]]:
        _, partial = self.scan(text, True, tools)
        calls = [ToolCall(c.name, c.arguments, **({"id": c.id} if c.id else {})) for c in partial if c.done]
        if not calls:
            return text, []
        content = text[: self.content_end(text)].strip()
        return content or None, calls

    def scan(self, text: str, final: bool, tools: list[dict] | None = None) -> list | tuple:
        """(where the calls start, the calls so far); formats parsed only whole give their calls at the end."""
        if not final:
            return self.content_end(text), []
        content, calls = self.parse(text, tools)
        return self.content_end(text), [PartialCall(c.name, c.arguments, True, c.id) for c in calls]

    def content_end(self, text: str) -> int:
        """How much of ``text`` (so far) is surely content: up to a start marker, or up to a prefix of one at the
        end (it may be a marker still arriving)."""
        i = text.find(self.start_marker)
        if i >= 0:
            return i
        for k in range(min(len(self.start_marker) - 1, len(text)), 0, -1):
            if self.start_marker.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class HermesParser(ToolParser):
    name, start_marker = "hermes", "<tool_call>"
    _pattern = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text, tools=None):
        if self.start_marker not in text:
            return text, []
        calls = []
        for body in self._pattern.findall(text):
            try:
                call = _call(json.loads(body))
            except (ValueError, RecursionError):
                call = None
            if call is None:
                return text, []  # not well-formed: the text stays content, as vLLM does
            calls.append(call)
        content = text[: text.find(self.start_marker)].strip()
        return content or None, calls


class Llama3JsonParser(ToolParser):
    name, start_marker = "llama3_json", "{"

    def parse(self, text, tools=None):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls, decoder, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except (ValueError, RecursionError):
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def content_end(self, text):
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith(("{", "<|python_tag|>"[: len(stripped)])) else len(text)


class MistralParser(ToolParser):
    name, start_marker = "mistral", "[TOOL_CALLS]"

    def parse(self, text, tools=None):
        i = text.find(self.start_marker)
        if i < 0:
            return text, []
        try:
            items = json.loads(text[i + len(self.start_marker):].strip())
        except (ValueError, RecursionError):
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call(obj) for obj in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return text[:i].strip() or None, calls


def _first(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str]:
    """(index, marker) of the first of ``markers`` in ``text`` from ``start``; (-1, "") if none."""
    found = [(i, m) for m in markers if (i := text.find(m, start)) >= 0]
    return min(found) if found else (-1, "")


class _MarkedParser(ToolParser):
    """Formats whose calls follow a start marker (``starts``): content is the text before it."""

    starts: tuple[str, ...] = ()

    def content_end(self, text):
        i, _ = _first(text, self.starts)
        return i if i >= 0 else len(text) - held_back(text, self.starts)

    def scan(self, text, final, tools=None):
        end = self.content_end(text)
        return end, (self.calls(text[end:], final, tools) if end < len(text) else [])

    def calls(self, text: str, final: bool, tools: list[dict] | None) -> list[PartialCall]:
        raise NotImplementedError


def _raw_arguments(body: str, ends: tuple[str, ...], final: bool) -> tuple[str, bool, int]:
    """(the JSON arguments written so far, whether they are closed by one of ``ends``, where the text after the
    end marker starts). Blank space around them and a marker's start are held back, so the text only grows."""
    i, marker = _first(body, ends)
    if i >= 0:
        return body[:i].strip(), True, i + len(marker)
    if final:
        return body.strip(), False, len(body)
    keep = held_back(body, ends)
    return body[: len(body) - keep].strip(), False, len(body)


class _JsonArgumentsParser(_MarkedParser):
    """Calls of ``call_start`` HEADER ``args_start`` JSON ``call_end``; ``header`` gives the name (and an id)."""

    call_start, args_start, call_end = "", "", ""

    def header(self, text: str) -> tuple[str, str | None]:
        return text.strip(), None

    def calls(self, text, final, tools):
        out, pos = [], 0
        while True:
            i = text.find(self.call_start, pos)
            if i < 0:
                return out
            j = text.find(self.args_start, i + len(self.call_start))
            if j < 0:
                return out  # the name is still arriving
            name, call_id = self.header(text[i + len(self.call_start): j])
            args, done, after = _raw_arguments(text[j + len(self.args_start):], (self.call_end,), final)
            out.append(PartialCall(name, args, done, call_id))
            if not done:
                return out
            pos = j + len(self.args_start) + after


class DeepSeekV3Parser(_JsonArgumentsParser):
    name = "deepseek_v3"
    starts = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")
    call_start, args_start, call_end = "<｜tool▁call▁begin｜>", "\n```json\n", "\n```<｜tool▁call▁end｜>"

    def header(self, text):
        return text.split("<｜tool▁sep｜>", 1)[-1].strip(), None


class DeepSeekV31Parser(_JsonArgumentsParser):
    name = "deepseek_v31"
    starts = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>")
    call_start, args_start, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class KimiK2Parser(_JsonArgumentsParser):
    name = "kimi_k2"
    starts = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")
    call_start, args_start, call_end = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

    def header(self, text):
        call_id = text.strip()
        return call_id.split(":")[0].removeprefix("functions."), call_id


def _schema_types(tools: list[dict] | None, name: str) -> dict[str, Any]:
    for tool in tools or ():
        fn = tool.get("function", {})
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties")
            return {k: (v or {}).get("type") for k, v in props.items()} if isinstance(props, dict) else {}
    return {}


def _typed(value: str, kind: Any) -> Any:
    """An XML argument's text as its schema's type: strings (and untyped arguments) stay text, as vLLM's."""
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is None or "string" in kinds:
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        if "boolean" in kinds and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        return value


def _json_object(pairs: list[tuple[str, Any]], done: bool) -> str:
    """The JSON arguments of the complete pairs so far: ``{"a": 1, "b": 2`` grows to ``{"a": 1, "b": 2}``."""
    text = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                           for k, v in pairs)
    return text + "}" if done else text


def _trim_newline(value: str) -> str:
    """One newline around a value is the template's layout, not the value."""
    return value.removeprefix("\n").removesuffix("\n")


def _xml_calls(text: str, tools: list[dict] | None, open_tag: str, name_ends: tuple[str, ...], close_tag: str,
               pair: re.Pattern, value=lambda v: v) -> list[PartialCall]:
    """Calls written as ``open_tag`` NAME (up to the first of ``name_ends``), KEY/VALUE pairs (``pair``'s two
    groups, each value through ``value`` and typed by the tool's schema), ``close_tag``; the last may be open."""
    out, pos = [], 0
    while (i := text.find(open_tag, pos)) >= 0:
        start = i + len(open_tag)
        j, _ = _first(text, name_ends, start)
        if j < 0:
            break  # the name is still arriving
        name = text[start:j].strip()
        k = text.find(close_tag, j)
        body = text[j: k if k >= 0 else len(text)]
        types = _schema_types(tools, name)
        pairs = [(key.strip(), _typed(value(v), types.get(key.strip()))) for key, v in pair.findall(body)]
        out.append(PartialCall(name, _json_object(pairs, k >= 0), k >= 0))
        if k < 0:
            break
        pos = k + len(close_tag)
    return out


class Qwen3CoderParser(_MarkedParser):
    name = "qwen3_coder"
    starts = ("<tool_call>", "<function=")
    _param = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)

    def calls(self, text, final, tools):
        return _xml_calls(text, tools, "<function=", (">",), "</function>", self._param, _trim_newline)


class Glm45Parser(_MarkedParser):
    name = "glm45"
    starts = ("<tool_call>",)
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def calls(self, text, final, tools):
        return _xml_calls(text, tools, "<tool_call>", ("<arg_key>", "\n", "</tool_call>"), "</tool_call>",
                          self._pair)


class PythonicParser(ToolParser):
    name = "pythonic"

    def content_end(self, text):
        stripped = text.lstrip()
        return 0 if not stripped or stripped.startswith("[") or "<|python_start|>".startswith(stripped[:16]) \
            or stripped.startswith("<|python_start|>") else len(text)

    def parse(self, text, tools=None):
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        if not body.startswith("["):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return text, []
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return text, []
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            return text, []
        return None, calls


class OpenAIParser(ToolParser):
    """gpt-oss: the calls are harmony messages (``jaxserve.text.reasoning.HarmonyStream``) addressed to
    ``functions.NAME``, their text the JSON arguments."""

    name = "openai"
    harmony = True

    def parse(self, text, tools=None):
        h = HarmonyStream()
        h.feed(text)
        h.finish()
        calls = [ToolCall(m.recipient.removeprefix("functions."), m.text.strip()) for m in h.messages
                 if m.recipient is not None and m.recipient.startswith("functions.")]
        content = "".join(m.text for m in h.messages if m.recipient is None and m.channel != "analysis")
        return (content or None, calls) if calls else (text, [])

    def content_end(self, text):
        return len(text)


PARSERS = {p.name: p for p in (DeepSeekV3Parser, DeepSeekV31Parser, Glm45Parser, HermesParser, KimiK2Parser,
                                Llama3JsonParser, MistralParser, OpenAIParser, PythonicParser, Qwen3CoderParser)}


def make_parser(name: str | None) -> ToolParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser={name!r} must be one of {', '.join(TOOL_CALL_PARSERS)}")
    return PARSERS[name]()
