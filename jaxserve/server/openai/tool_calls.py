"""Tool calling for the chat API: the model's text turned into OpenAI ``tool_calls`` by a ``--tool-call-parser``
(``tool_parsers``), streamed as vLLM streams them, and ``tool_choice`` "required" or a named function enforced
with structured output."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.server.intake import JSONSyntaxError, decode_json, invalid
from jaxserve.server.openai.tool_parsers import TOOL_CALL_PARSERS, PartialCall, ToolCall, ToolParser, make_parser

__all__ = ["TOOL_CALL_PARSERS", "ToolCall", "ToolCallStream", "ToolParser", "check_tools", "forced_calls",
           "forced_schema", "make_parser", "template_message"]

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
    """One choice's text under tool calling, as it streams: ``feed(piece)`` gives (content that can go out now,
    vLLM's tool-call deltas), ``finish()`` the rest; ``calls`` are the complete calls at the end. ``tools``: the
    request's (the XML formats type their arguments by them)."""

    def __init__(self, parser: ToolParser | None, forced: bool, forced_name: str | None,
                 tools: list[dict] | None = None):
        self.parser, self.forced, self.forced_name, self.tools = parser, forced, forced_name, tools
        self.text, self.sent = "", 0
        self.streamed: list[PartialCall] = []  # what of each call has gone out
        self.ids: list[str] = []
        self.calls: list[ToolCall] = []

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        self.text += piece
        if self.forced:
            return "", []
        if self.parser is None:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        end, partial = self.parser.scan(self.text, False, self.tools)
        return self._content(end), self.deltas(partial)

    def finish(self) -> tuple[str, list[dict]]:
        if self.forced:
            self.calls = forced_calls(self.text, self.forced_name)
            return "", [c.to_openai(k) for k, c in enumerate(self.calls)]
        if self.parser is None:
            return self.feed("")[0], []
        end, partial = self.parser.scan(self.text, True, self.tools)
        done = [c for c in partial if c.done]
        deltas = self.deltas(done if not self.streamed else partial)
        self.calls = [ToolCall(c.name, c.arguments, self.ids[k]) for k, c in enumerate(partial) if c.done]
        if not self.streamed:  # no call: all of it is content
            end = len(self.text)
        return self._content(end), deltas

    def _content(self, end: int) -> str:
        out = self.text[self.sent: max(self.sent, end)]
        self.sent = max(self.sent, end)
        return out

    def deltas(self, partial: list[PartialCall]) -> list[dict]:
        """vLLM's streamed shape: a call's first delta has its index, id, type and name; the next ones add to
        its arguments."""
        deltas = []
        for k, call in enumerate(partial):
            if k == len(self.streamed):
                self.ids.append(call.id or ToolCall(call.name, "").id)
                self.streamed.append(PartialCall(call.name))
                deltas.append({"index": k, "id": self.ids[k], "type": "function", "function": {"name": call.name}})
            sent = self.streamed[k]
            if len(call.arguments) > len(sent.arguments) and call.arguments.startswith(sent.arguments):
                frag = call.arguments[len(sent.arguments):]
                sent.arguments = call.arguments
                deltas.append({"index": k, "function": {"arguments": frag}})
        return deltas
