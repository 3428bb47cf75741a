"""Tool calling for the chat API: the model's text turned into OpenAI ``tool_calls`` (``--tool-call-parser``), and
``tool_choice`` "required" or a named function enforced with structured output.

Parsers (vLLM's names and formats):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, text around them is content;
- ``llama3_json``: a JSON object ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), optionally after
  ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name": ..., "arguments": {...}}``.

Streaming: text is streamed as content until a parser's start marker appears; from there the rest is held and
the calls go out in one delta when the output ends.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxserve.server.intake import JSONSyntaxError, decode_json, invalid

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


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


class ToolParser:
    """Splits a finished output into (content, tool calls); ``start`` is where a streamed output stops being
    content."""

    name = ""
    start_marker = ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

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

    def parse(self, text):
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

    def parse(self, text):
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

    def parse(self, text):
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


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def make_parser(name: str | None) -> ToolParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser={name!r} must be one of {', '.join(TOOL_CALL_PARSERS)}")
    return PARSERS[name]()


# Requests -------------------------------------------------------------------------------------------------------
def check_tools(tools: list[Any] | None) -> list[dict]:
    """The request's ``tools`` (OpenAI function tools), checked; 400 naming the field otherwise."""
    out = []
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                          "...}}}", "tools")
        params = fn.get("parameters", {"type": "object"})
        if isinstance(params, str):  # JSON text: the body's limits
            params = decode_json(params, "tools")
        if not isinstance(params, dict):
            raise invalid(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def forced_schema(tools: list[dict], tool_choice: Any, parallel: bool = True) -> tuple[dict | None, str | None]:
    """(JSON schema the output must match, the forced function's name) for ``tool_choice``: "required" -> a
    non-empty list of ``{"name", "parameters"}`` calls to the given tools (one call only without ``parallel``,
    OpenAI's ``parallel_tool_calls: false``); a named function -> its
    parameters; "auto" / "none" -> (None, None). 400 for a choice that names no given tool."""
    if tool_choice in (None, "auto", "none"):
        return None, None
    if tool_choice == "required":
        if not tools:
            raise invalid("tool_choice='required' needs tools", "tool_choice")
        variants = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                      "parameters": t["function"]["parameters"]},
                     "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if not parallel:
            schema["maxItems"] = 1
        return schema, None
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    match = next((t for t in tools if t["function"]["name"] == name), None)
    if match is None:
        raise invalid(f"tool_choice={tool_choice!r} must be 'auto', 'none', 'required' or "
                      "{'type': 'function', 'function': {'name': NAME}} naming one of the tools", "tool_choice")
    return match["function"]["parameters"], name


def forced_calls(text: str, forced_name: str | None) -> list[ToolCall]:
    """The calls of an output made under a forced ``tool_choice`` (its text matches ``forced_schema``)."""
    if forced_name is not None:
        return [ToolCall(forced_name, text.strip())]
    try:
        items = json.loads(text)
    except (ValueError, RecursionError):
        return []  # cut short (max_tokens): no complete call
    return [ToolCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]


def template_message(message: dict) -> dict:
    """A history message as chat templates expect it: an assistant's ``tool_calls`` with their arguments as
    objects (OpenAI sends JSON text), as vLLM passes them."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:  # the body's limits: a template walks what this returns
                fn["arguments"] = decode_json(fn["arguments"], "messages")
            except JSONSyntaxError:
                pass  # not JSON: the template gets the text
        fixed.append({**call, "function": fn})
    return {**message, "tool_calls": fixed}


class ToolCallStream:
    """One streamed choice's text under tool calling: what can go out as content now (``feed``), and at the end
    the rest of the content and the calls (``finish``)."""

    def __init__(self, parser: ToolParser | None, forced: bool, forced_name: str | None):
        self.parser, self.forced, self.forced_name = parser, forced, forced_name
        self.text, self.sent = "", 0

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.forced:
            return ""
        end = self.parser.content_end(self.text) if self.parser is not None else len(self.text)
        out = self.text[self.sent: max(self.sent, end)]
        self.sent = max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        if self.forced:
            return "", forced_calls(self.text, self.forced_name)
        calls = self.parser.parse(self.text)[1] if self.parser is not None else []
        end = self.parser.content_end(self.text) if calls else len(self.text)
        return self.text[self.sent: max(self.sent, end)], calls
