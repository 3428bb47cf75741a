"""An answer of the Messages API as Anthropic's content blocks: thinking (the reasoning the parser split off),
text and tool_use, built from a ``ChoiceOutput``'s deltas, with the stream events that build them, so a whole
answer and a streamed one come out the same; and Anthropic's ``stop_reason``."""

from __future__ import annotations

import json
import uuid
from typing import Any

from jaxserve.server.openai.chat_output import OutputDelta


def stop_reason(finish: str | None, stop: str | int | None, tool_use: bool) -> tuple[str, str | None]:
    """(Anthropic's ``stop_reason``, the ``stop_sequence`` matched) of a finished answer."""
    if finish == "length":
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class MessageContent:
    """An answer's content blocks, built from its ``ChoiceOutput`` deltas: each delta's reasoning into a
    thinking block, its text into a text block, each tool call into a tool_use block (a new block whenever the
    kind changes). ``add`` and ``close`` give the stream events they make; after ``close``, ``blocks`` is the
    whole message's content, the same whether the answer came whole or streamed."""

    def __init__(self):
        self.blocks: list[dict[str, Any]] = []
        self.open: str | None = None  # the type of the block being written
        self.call_blocks: dict[int, int] = {}  # a tool call's index -> its block
        self.inputs: dict[int, str] = {}  # a tool_use block -> its input's JSON text so far

    def add(self, delta: OutputDelta) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning:
            events += self._write("thinking", delta.reasoning)
        if delta.content:
            events += self._write("text", delta.content)
        for call in delta.tool_calls:
            events += self._call(call)
        return events

    def close(self) -> list[dict[str, Any]]:
        """End the block being written: a thinking block gets its signature, a tool_use block its input."""
        if self.open is None:
            return []
        index, block, events = len(self.blocks) - 1, self.blocks[-1], []
        if self.open == "thinking":
            block["signature"] = uuid.uuid4().hex  # opaque, as vLLM's; not checked when sent back
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": block["signature"]}})
        elif self.open == "tool_use":
            try:
                parsed = json.loads(self.inputs.get(index) or "{}")
            except json.JSONDecodeError:  # cut off (max_tokens): no input
                parsed = {}
            block["input"] = parsed if isinstance(parsed, dict) else {}
        self.open = None
        return events + [{"type": "content_block_stop", "index": index}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.blocks.append(block)
        self.open = block["type"]
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _write(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events = []
        if self.open != kind:
            events += self._start({"type": kind, kind: ""} if kind == "text" else
                                  {"type": kind, kind: "", "signature": ""})
        self.blocks[-1][kind] += piece
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": {"type": f"{kind}_delta", kind: piece}}]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """One of vLLM's streamed tool-call deltas: the first of a call (its id and name) opens its block; its
        arguments' text goes to the block as ``input_json_delta``s while that block is open."""
        events = []
        fn = call.get("function") or {}
        if call.get("id") is not None:
            events += self._start({"type": "tool_use", "id": call["id"], "name": fn.get("name") or "",
                                   "input": {}})
            self.call_blocks[call.get("index", 0)] = len(self.blocks) - 1
        index = self.call_blocks.get(call.get("index", 0))
        arguments = fn.get("arguments")
        if arguments and index == len(self.blocks) - 1 and self.open == "tool_use":
            self.inputs[index] = self.inputs.get(index, "") + arguments
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": arguments}})
        return events
