"""OpenAI's Responses API, ``POST /v1/responses``, as vLLM serves it: the request translated into a chat
completions request and run through ``ChatCompletions.start`` (the chat template, the sampling fields, the tools
and ``--tool-call-parser``, the reasoning parser, structured output), the answer given back as the response's
output items (reasoning, message, function_call), whole or as the Responses API's named stream events.

The output items are built by ``response_output``. A response with ``store`` (the default, as OpenAI's) is kept
in a bounded in-memory store (``ResponseStore``: the most recent ``MAX_STORED_RESPONSES``), so a later request's
``previous_response_id`` continues its conversation (its input and output items before the new input; its
instructions are not carried over, as OpenAI's are not) and ``GET /v1/responses/{id}`` reads it back.
``background`` is refused. Fields the request's types do not know are ignored, as vLLM ignores them.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import grpc
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictBool

from jaxserve.server.intake import RequestError, from_engine_error, invalid, usage_counts
from jaxserve.server.openai.chat import ChatCompletions, ChatRun
from jaxserve.server.openai.context import APIContext, json_body
from jaxserve.server.openai.errors import raise_if_failed
from jaxserve.server.openai.protocol import ChatCompletionRequest, _Body, parse
from jaxserve.server.openai.response_output import ResponseOutput
from jaxserve.server.openai.streaming import EventStream, named_events


class InputItem(_Body):
    """One item of ``input`` (the fields of every type this API reads): a message, a function_call, a
    function_call_output or a reasoning item."""

    type: str | None = None  # a message may leave it out
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[dict[str, Any]] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None  # function_call_output
    summary: list[dict[str, Any]] | None = None  # reasoning


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: StrictBool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted and not read


class ReasoningConfig(_Body):
    effort: str | None = None
    summary: str | None = None  # accepted and not read: no summaries are written
    generate_summary: str | None = None


class ResponsesRequest(_Body):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = []
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: StrictBool = False
    store: StrictBool | None = True  # kept in the server's ResponseStore (OpenAI's default)
    previous_response_id: str | None = None  # a stored response whose conversation this one continues
    background: StrictBool = False  # refused with true
    metadata: dict[str, str] | None = None  # echoed in the response
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None  # refused, as vLLM refuses it
    # vLLM's extras
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # its options tune text.format's constraint


# The chat completions request ---------------------------------------------------------------------------------
def _text(content: str | list[dict[str, Any]] | None, where: str, kinds: tuple[str, ...]) -> str:
    """A message's (or a function_call_output's) content as text: a string, or its text parts joined by
    newlines, as vLLM joins a chat message's text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise invalid(f"{where}[{j}]: a part of type {kind!r} is not supported (the server takes "
                          f"{' and '.join(kinds)} parts only)", "input")
        texts.append(part["text"])
    return "\n".join(texts)


MAX_STORED_RESPONSES = 1024


class ResponseStore:
    """The stored responses, the most recent ``limit`` (thread-safe): each one's body, and its conversation as
    input items (every earlier turn's input and output, then its own), which ``previous_response_id`` continues."""

    def __init__(self, limit: int = MAX_STORED_RESPONSES):
        self.limit = limit
        self._items: collections.OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, rid: str, conversation: list[dict[str, Any]], body: dict[str, Any]) -> None:
        with self._lock:
            self._items[rid] = (conversation, body)
            while len(self._items) > self.limit:
                self._items.popitem(last=False)

    def get(self, rid: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(conversation, body) of a stored response; 404 naming ``previous_response_id`` if it is not kept."""
        with self._lock:
            found = self._items.get(rid)
        if found is None:
            raise RequestError(f"Response with id '{rid}' not found (responses are kept in memory, the most recent "
                               f"{self.limit}, and only with store)", status=404, code=grpc.StatusCode.NOT_FOUND,
                               type="NotFoundError", param="previous_response_id", reason="not_found")
        return found


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return [item.model_dump(exclude_none=True) for item in req.input]


def _chat_messages(req: ResponsesRequest, history: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The input (after ``history``, a stored conversation's items) as chat messages, as vLLM builds them: the
    instructions first as the system message; a function_call joins the assistant message before it (its
    tool_calls), a function_call_output is a tool message, a reasoning item the reasoning of the assistant
    message it opens or joins. A developer message is a system message (chat templates know no developer
    role)."""
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if not req.input:
        raise invalid("input is empty", "input")
    items = [InputItem.model_validate(item) for item in history]
    items += [InputItem(type="message", role="user", content=req.input)] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.type or ("message" if item.role is not None else None)
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        if kind == "message":
            if item.role is None:
                raise invalid(f"{where}: a message needs a role", "input")
            parts = ("output_text", "refusal") if item.role == "assistant" else ("input_text",)
            text = _text(item.content, f"{where}.content", parts + ("text",))
            if item.role == "assistant" and last is not None and last.get("content") is None:
                last["content"] = text
            else:
                out.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif kind == "function_call":
            if not item.call_id or not item.name or item.arguments is None:
                raise invalid(f"{where}: a function_call needs call_id, name and arguments", "input")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if last is not None:
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id or item.output is None:
                raise invalid(f"{where}: a function_call_output needs call_id and output", "input")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output, f"{where}.output", ("input_text",))})
        elif kind == "reasoning":
            texts = item.content if item.content else item.summary
            reasoning = _text(texts[:1] if isinstance(texts, list) else texts, f"{where}.content",
                              ("reasoning_text", "summary_text"))
            if last is not None and last.get("reasoning") is None:
                last["reasoning"] = reasoning
            else:
                out.append({"role": "assistant", "content": None, "reasoning": reasoning})
        else:
            raise invalid(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                          "function_call_output, reasoning)", "input")
    return out


def chat_request(req: ResponsesRequest, history: list[dict[str, Any]] = ()) -> ChatCompletionRequest:
    """The chat completions request a Responses request is answered as (after ``history``, the conversation of
    its ``previous_response_id``); 400 naming the field it cannot take."""
    if req.background:
        raise invalid("background is not supported: a response is answered while the request waits",
                      "background")
    if req.prompt is not None:
        raise invalid("prompt templates are not supported", "prompt")
    if req.truncation == "auto":
        raise invalid("truncation 'auto' is not supported (a prompt too long for the context is refused)",
                      "truncation")
    if "message.output_text.logprobs" in (req.include or ()):
        raise invalid("include 'message.output_text.logprobs' is not supported", "include")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise invalid(f"max_output_tokens={req.max_output_tokens} must be at least 1", "max_output_tokens")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs = {"reasoning_effort": req.reasoning.effort, **kwargs}  # as vLLM passes it to the template
    body: dict[str, Any] = {
        "model": req.model, "messages": _chat_messages(req, history), "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
        "stop": req.stop, "repetition_penalty": req.repetition_penalty, "user": req.user,
        "chat_template_kwargs": kwargs or None, "structured_outputs": req.structured_outputs}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
        choice = req.tool_choice
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
        body["parallel_tool_calls"] = req.parallel_tool_calls
    elif isinstance(req.tool_choice, NamedFunction) or req.tool_choice == "required":
        raise invalid("tool_choice names a tool, but no tools are given", "tool_choice")
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise invalid("text.format.schema is required with type 'json_schema'", "text")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                          "schema": fmt.schema_}}
    return parse(ChatCompletionRequest, body)


def in_band(e: Exception) -> dict[str, Any]:
    """The ``error`` event of a stream that failed after its status line went out (the stream numbers it)."""
    err = from_engine_error(e)
    return {"type": "error", "code": err.type, "message": err.message, "param": err.param}


class Responses:
    """The Responses API over the chat completions machinery (``chat``: the server's ``ChatCompletions``)."""

    bodies = (ResponsesRequest,)

    def __init__(self, ctx: APIContext, chat: ChatCompletions, store: ResponseStore | None = None):
        self.ctx = ctx
        self.chat = chat
        self.store = store or ResponseStore()

    def router(self) -> APIRouter:
        router = self.ctx.router("/v1")
        router.add_api_route("/responses", self.responses, methods=["POST"], openapi_extra=json_body(ResponsesRequest))
        router.add_api_route("/responses/{response_id}", self.retrieve, methods=["GET"])
        return router

    async def retrieve(self, response_id: str) -> Response:
        """``GET /v1/responses/{id}``: a stored response as it was answered."""
        try:
            return JSONResponse(self.store.get(response_id)[1])
        except RequestError as e:
            e.param = None
            raise

    async def responses(self, request: Request) -> Response:
        ctx = self.ctx
        req: ResponsesRequest = parse(ResponsesRequest, await ctx.read_json(request))
        history = self.store.get(req.previous_response_id)[0] if req.previous_response_id is not None else []
        run = await self.chat.start(request, chat_request(req, history))
        rid = f"resp_{uuid.uuid4().hex}"
        head = self._head(req, run, rid, int(time.time()))
        conversation = history + input_items(req)

        def keep(body: dict[str, Any]) -> None:
            if req.store is not False:
                self.store.put(rid, conversation + body["output"], body)

        if req.stream:
            return EventStream(named_events(self._events(run, head, keep), in_band), run.stream.abort)
        out = await run.final(ctx, request)
        if out is None:
            return Response(status_code=499)
        c = out.outputs[0]
        output = ResponseOutput()
        for delta in run.read(c.text)[1]:
            output.add(delta)
        incomplete = c.finish_reason == "length"
        output.close("incomplete" if incomplete else "completed")
        body = self._finished(head, output, out, incomplete, await run.reasoning_tokens(self.ctx, c.token_ids))
        keep(body)
        return JSONResponse(body)

    def _head(self, req: ResponsesRequest, run: ChatRun, rid: str, created: int) -> dict[str, Any]:
        """The response's fields that do not depend on its output (the request's settings, echoed as vLLM
        echoes them), with status in_progress."""
        params = run.params
        return {"id": rid, "object": "response", "created_at": created, "status": "in_progress", "error": None,
                "incomplete_details": None, "instructions": req.instructions, "metadata": req.metadata,
                "model": self.ctx.model_name(req.model), "output": [],
                "parallel_tool_calls": req.parallel_tool_calls, "temperature": params.temperature,
                "tool_choice": req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump(),
                "tools": [t.model_dump(exclude_none=True) for t in req.tools], "top_p": params.top_p,
                "background": False, "max_output_tokens": params.max_tokens,
                "previous_response_id": req.previous_response_id, "store": req.store is not False,
                "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
                "service_tier": "auto",
                "text": {"format": _format(req)}, "truncation": "disabled", "usage": None, "user": req.user}

    def _finished(self, head: dict[str, Any], output: ResponseOutput, out, incomplete: bool,
                  reasoning_tokens: int) -> dict[str, Any]:
        counts = usage_counts(out)
        usage = {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
                 "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"],
                 "input_tokens_details": {"cached_tokens": counts["cached_tokens"], "cache_write_tokens": 0},
                 "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}
        return {**head, "status": "incomplete" if incomplete else "completed", "output": output.items,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "usage": usage}

    async def _events(self, run: ChatRun, head: dict[str, Any],
                      keep: Callable[[dict[str, Any]], None]) -> AsyncIterator[dict[str, Any]]:
        """The stream's events, numbered: response.created and response.in_progress, each item's events, then
        response.completed with the whole response (its status "incomplete" if cut off, as vLLM sends it)."""
        seq = 0

        def numbered(event: dict[str, Any]) -> dict[str, Any]:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            return event

        yield numbered({"type": "response.created", "response": head})
        yield numbered({"type": "response.in_progress", "response": head})
        try:
            async for event in self._output_events(run, head):
                if event["type"] == "response.completed":
                    keep(event["response"])
                yield numbered(event)
        except Exception as e:  # noqa: BLE001 - the status line is already sent; report in-band
            yield numbered(in_band(e))

    async def _output_events(self, run: ChatRun, head: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The events of the output items as the answer streams, then response.completed."""
        output, finish = ResponseOutput(), None
        async for delta, done in run.read_stream(run.reader()):
            for event in output.add(delta):
                yield event
            if done is not None:
                finish = done.finish_reason
        final = run.output
        if final is None:  # aborted: the client has gone
            return
        raise_if_failed([final])
        incomplete = finish == "length"
        for event in output.close("incomplete" if incomplete else "completed"):
            yield event
        yield {"type": "response.completed",
               "response": self._finished(head, output, final, incomplete,
                                          await run.reasoning_tokens(self.ctx, final.outputs[0].token_ids))}

def _format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text is not None else None
    if fmt is None:
        return {"type": "text"}
    return fmt.model_dump(exclude_none=True, by_alias=True)
