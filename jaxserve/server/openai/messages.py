"""Anthropic's Messages API, ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``, as vLLM serves it: the
request translated into a chat completions request and run through ``ChatCompletions.start`` (the chat template,
the sampling fields, the tools and ``--tool-call-parser``, the reasoning parser), the answer given back as
Anthropic's content blocks (thinking, text, tool_use), whole or as Anthropic's named stream events, and every
failure in Anthropic's error shape.

The answer's blocks are built by ``message_content``. Fields the request's types do not know are ignored, as vLLM
ignores them; ``thinking`` (which vLLM ignores) sets the chat template's thinking switches, which the reasoning
parser reads.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import StrictBool

from jaxserve.server.intake import invalid, usage_counts
from jaxserve.server.openai.chat import ChatCompletions, ChatRun
from jaxserve.server.openai.context import APIContext, json_body
from jaxserve.server.openai.errors import anthropic_in_band, anthropic_route, engine_errors, raise_if_failed
from jaxserve.server.openai.message_content import MessageContent, stop_reason
from jaxserve.server.openai.protocol import ChatCompletionRequest, _Body, parse
from jaxserve.server.openai.streaming import EventStream, named_events


class ContentBlock(_Body):
    """One block of a message's content (the fields of every type this API reads)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: StrictBool | None = None
    thinking: str | None = None  # thinking (its signature is not checked)
    signature: str | None = None


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # read, not enforced: no cap on the reasoning's length


class _Conversation(_Body):
    model: str
    messages: list[InputMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra


class MessagesRequest(_Conversation):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None  # accepted and not read (user_id)
    stream: StrictBool = False


class CountTokensRequest(_Conversation):
    pass


# The chat completions request ---------------------------------------------------------------------------------
def _text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """A tool_result's content as text: a string, or text blocks joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{where}.content[{j}]: a tool_result's content may hold only text blocks", "messages")
        texts.append(block["text"])
    return "\n".join(texts)


def _chat_messages(req: _Conversation) -> list[dict[str, Any]]:
    """The conversation as chat completions messages: the system prompt first, each tool_result as a tool
    message (before the rest of its user turn), an assistant's tool_use blocks as its tool_calls and its
    thinking blocks as its reasoning."""
    out: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(
            b.text or "" for b in req.system if b.type == "text")  # vLLM joins the text blocks as they are
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if not m.content:
            raise invalid(f"messages[{i}].content is empty", "messages")
        texts, calls, reasoning = [], [], []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text":
                texts.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                calls.append({"id": b.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": b.name or "", "arguments": json.dumps(b.input or {})}})
            elif b.type == "tool_result" and m.role == "user":
                out.append({"role": "tool", "tool_call_id": b.tool_use_id or "",
                            "content": _text_of(b.content, where)})
            elif b.type == "thinking" and m.role == "assistant":
                reasoning.append(b.thinking or "")
            elif b.type == "redacted_thinking" and m.role == "assistant":
                pass  # opaque; accepted so a client can send an answer back as it came
            elif b.type in ("image", "document"):
                raise invalid(f"{where}: {b.type} blocks are not supported (the server takes text only)",
                              "messages")
            else:
                raise invalid(f"{where}: a {m.role} message cannot hold a block of type {b.type!r}", "messages")
        if texts or calls or reasoning or m.role == "assistant":
            message: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning"] = "".join(reasoning)
            out.append(message)
    return out


def _template_kwargs(req: _Conversation) -> dict[str, Any] | None:
    """The chat template's switches: ``thinking`` sets ``enable_thinking`` and ``thinking`` (the names the
    templates and the reasoning parsers read), under the request's own ``chat_template_kwargs``."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.thinking is not None:
        if req.thinking.type == "enabled" and req.thinking.budget_tokens is None:
            raise invalid("thinking.budget_tokens is required with thinking.type 'enabled'", "thinking")
        if req.thinking.budget_tokens is not None and req.thinking.budget_tokens < 1:
            raise invalid("thinking.budget_tokens must be positive", "thinking")
        on = req.thinking.type != "disabled"
        kwargs = {"enable_thinking": on, "thinking": on, **kwargs}
    return kwargs or None


def chat_request(req: _Conversation) -> ChatCompletionRequest:
    """The chat completions request a Messages request (or a count_tokens one) is answered as."""
    body: dict[str, Any] = {"model": req.model, "messages": _chat_messages(req),
                            "chat_template_kwargs": _template_kwargs(req)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                           "parameters": t.input_schema}} for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise invalid("tool_choice.name is required with tool_choice.type 'tool'", "tool_choice")
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type, {"type": "function", "function": {"name": choice.name}})
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    elif req.tools:
        body["tool_choice"] = "auto"  # vLLM's default with tools
    if isinstance(req, MessagesRequest):
        if req.max_tokens < 1:
            raise invalid(f"max_tokens={req.max_tokens} must be at least 1", "max_tokens")
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, temperature=req.temperature,
                    top_p=req.top_p, top_k=req.top_k)
    return parse(ChatCompletionRequest, body)


class Messages:
    """The Messages API over the chat completions machinery (``chat``: the server's ``ChatCompletions``)."""

    bodies = (MessagesRequest, CountTokensRequest)

    def __init__(self, ctx: APIContext, chat: ChatCompletions):
        self.ctx = ctx
        self.chat = chat

    def router(self) -> APIRouter:
        router = self.ctx.router("/v1", x_api_key=True, route_class=anthropic_route(self.ctx.metrics))
        router.add_api_route("/messages", self.messages, methods=["POST"], openapi_extra=json_body(MessagesRequest))
        router.add_api_route("/messages/count_tokens", self.count_tokens, methods=["POST"],
                             openapi_extra=json_body(CountTokensRequest))
        return router

    async def messages(self, request: Request) -> Response:
        ctx = self.ctx
        req: MessagesRequest = parse(MessagesRequest, await ctx.read_json(request))
        ctx.lora_for(req.model)  # vLLM's 404 for a model neither served nor an adapter (not_found_error here)
        run = await self.chat.start(request, chat_request(req))
        mid, model = f"msg_{uuid.uuid4().hex}", req.model
        if req.stream:
            return EventStream(named_events(self._events(run, mid, model), anthropic_in_band), run.stream.abort)
        out = await run.final(ctx, request)
        if out is None:
            return Response(status_code=499)
        c = out.outputs[0]
        parsed, deltas = run.read(c.text)
        content = MessageContent()
        for delta in deltas:
            content.add(delta)
        content.close()
        reason, sequence = stop_reason(c.finish_reason, c.stop_reason, bool(parsed.calls))
        counts = usage_counts(out)
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": model,
                             "content": content.blocks, "stop_reason": reason, "stop_sequence": sequence,
                             "usage": {"input_tokens": counts["prompt_tokens"],
                                       "output_tokens": counts["completion_tokens"]}})

    async def _events(self, run: ChatRun, mid: str, model: str) -> AsyncIterator[dict[str, Any]]:
        """The stream's events: message_start, each block's start, deltas and stop, message_delta (the stop
        reason and the output's token count), message_stop."""
        yield {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": len(run.stream.prompt_token_ids), "output_tokens": 0}}}
        parsed, content = run.reader(), MessageContent()
        finish = None
        async for delta, done in run.read_stream(parsed):
            for event in content.add(delta):
                yield event
            if done is not None:
                finish = stop_reason(done.finish_reason, done.stop_reason, bool(parsed.calls))
        final = run.output
        for event in content.close():
            yield event
        if final is not None and final.error is not None:
            raise_if_failed([final])
        reason, sequence = finish or ("end_turn", None)
        counts = usage_counts(final) if final is not None else {"prompt_tokens": 0, "completion_tokens": 0}
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"]}}
        yield {"type": "message_stop"}

    async def count_tokens(self, request: Request) -> JSONResponse:
        """The prompt's token count as ``/v1/messages`` would run it (vLLM's ``{"input_tokens": N}``)."""
        ctx = self.ctx
        req: CountTokensRequest = parse(CountTokensRequest, await ctx.read_json(request))
        ctx.lora_for(req.model)
        chat = chat_request(req)
        chat.tool_schema()  # the tools checked as a Messages request checks them
        options = {**chat.template_options(), "add_special_tokens": chat.add_special_tokens}
        with engine_errors():
            ids = await ctx.engine.tokenize_prompt(None, chat.template_messages(), chat.add_generation_prompt,
                                                   template_options=options)
        return JSONResponse({"input_tokens": len(ids)})
