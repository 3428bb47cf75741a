"""An answer of the Responses API as its output items: a reasoning item (the reasoning the parser split off), a
message item (the text, one ``output_text`` part) and a function_call item per tool call, built from a
``ChoiceOutput``'s deltas, with the stream events that build them (``response.output_item.added``, the content
part's, the deltas, and the ``.done`` events), so a whole answer and a streamed one come out the same.

The events carry no ``sequence_number``: the stream numbers them as they go out.
"""

from __future__ import annotations

import uuid
from typing import Any

from jaxserve.server.openai.chat_output import OutputDelta


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """An answer's output items, built from its ``ChoiceOutput`` deltas: reasoning into a reasoning item, text
    into a message item, each tool call into a function_call item (a new item whenever the kind changes).
    ``add`` and ``close`` give the stream events they make; after ``close``, ``items`` is the response's
    ``output``. Text that is only whitespace just before a call is dropped, as vLLM drops it."""

    def __init__(self):
        self.items: list[dict[str, Any]] = []
        self.open: str | None = None  # the type of the item being written
        self.call_items: dict[int, int] = {}  # a tool call's index -> its item
        self.spaces = ""  # whitespace not yet written: it opens a message only if more text follows

    def add(self, delta: OutputDelta) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning:
            events += self._flush()
            events += self._write("reasoning", delta.reasoning)
        if delta.content:
            if self.open != "message" and not (self.spaces + delta.content).strip():
                self.spaces += delta.content
            else:
                events += self._write("message", self.spaces + delta.content)
                self.spaces = ""
        for call in delta.tool_calls:
            if call.get("id") is not None:
                self.spaces = ""
            events += self._call(call)
        return events

    def close(self, status: str = "completed") -> list[dict[str, Any]]:
        """End the output: the item being written gets ``status`` ("incomplete": the answer was cut off)."""
        return self._flush() + self._end(status)

    @property
    def text(self) -> str:
        """The messages' text (the client's ``output_text``)."""
        return "".join(part["text"] for item in self.items if item["type"] == "message" for part in item["content"])

    def _flush(self) -> list[dict[str, Any]]:
        spaces, self.spaces = self.spaces, ""
        return self._write("message", spaces) if spaces else []

    def _where(self) -> dict[str, Any]:
        return {"output_index": len(self.items) - 1, "item_id": self.items[-1]["id"]}

    def _end(self, status: str = "completed") -> list[dict[str, Any]]:
        if self.open is None:
            return []
        item, where, events = self.items[-1], self._where(), []
        if self.open == "reasoning":
            part = item["content"][0]
            events += [{"type": "response.reasoning_text.done", **where, "content_index": 0, "text": part["text"]},
                       {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        elif self.open == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                        "logprobs": []},
                       {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        else:
            events.append({"type": "response.function_call_arguments.done", **where,
                           "arguments": item["arguments"]})
        item["status"] = status
        self.open = None
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"],
                          "item": _copy(item)}]

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._end()
        self.items.append(item)
        self.open = item["type"]
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": _copy(item)})
        return events

    def _write(self, kind: str, piece: str) -> list[dict[str, Any]]:
        events = []
        part_type = "reasoning_text" if kind == "reasoning" else "output_text"
        if self.open != kind:
            if kind == "reasoning":
                item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"}
                part = {"type": part_type, "text": ""}
            else:
                item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": [],
                        "status": "in_progress"}
                part = {"type": part_type, "text": "", "annotations": []}
            events += self._start(item)
            item["content"].append(part)
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": dict(part)})
        self.items[-1]["content"][0]["text"] += piece
        delta = {"type": f"response.{part_type}.delta", **self._where(), "content_index": 0, "delta": piece}
        if kind == "message":
            delta["logprobs"] = []
        return events + [delta]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """One of vLLM's streamed tool-call deltas: the first of a call (its id and name) opens its item; its
        arguments' text goes to the item as ``function_call_arguments.delta`` events while it is open."""
        events = []
        fn = call.get("function") or {}
        if call.get("id") is not None:
            events += self._start({"id": _id("fc"), "type": "function_call", "call_id": call["id"],
                                   "name": fn.get("name") or "", "arguments": "", "status": "in_progress"})
            self.call_items[call.get("index", 0)] = len(self.items) - 1
        index = self.call_items.get(call.get("index", 0))
        arguments = fn.get("arguments")
        if arguments and index == len(self.items) - 1 and self.open == "function_call":
            self.items[index]["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": arguments})
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as an event carries it: a snapshot, not the item that goes on growing."""
    return {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)
