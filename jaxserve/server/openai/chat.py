"""``POST /v1/chat/completions``: a conversation through the chat template, ``n`` choices, streamed or not, with
tools (the model's calls parsed by ``--tool-call-parser``, or forced by ``tool_choice``), OpenAI's
``logprobs`` and vLLM's ``prompt_logprobs`` and ``return_token_ids``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.server.intake import ChoiceTracker, invalid
from jaxserve.server.openai.context import APIContext, json_body
from jaxserve.server.openai.errors import in_band, raise_if_failed
from jaxserve.server.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from jaxserve.server.openai.protocol import ChatCompletionRequest, parse
from jaxserve.server.openai.streaming import EventStream, events
from jaxserve.server.openai.tool_calls import ToolCallStream, make_parser


class ChatCompletions:
    """The chat completions API; ``enable_auto_tool_choice`` and ``tool_call_parser`` are the server flags that
    let ``tool_choice`` "auto" parse the model's own calls."""

    bodies = (ChatCompletionRequest,)

    def __init__(self, ctx: APIContext, *, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None):
        self.ctx = ctx
        self.auto_tools = enable_auto_tool_choice
        self.tool_parser = make_parser(tool_call_parser)

    def router(self) -> APIRouter:
        router = self.ctx.router("/v1")
        router.add_api_route("/chat/completions", self.chat_completions, methods=["POST"],
                             openapi_extra=json_body(ChatCompletionRequest))
        return router

    async def chat_completions(self, request: Request) -> Response:
        ctx = self.ctx
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await ctx.read_json(request))
        lora = ctx.lora_for(req.model)
        ctx.limits.check(n=req.n, logprobs=req.top_logprobs, stop=req.stop, stop_token_ids=req.stop_token_ids,
                         logprobs_field="top_logprobs")
        if req.prompt_logprobs is not None:
            ctx.limits.check(logprobs=req.prompt_logprobs, logprobs_field="prompt_logprobs")
        req.cache_salt = ctx.cache_salt(request, req.cache_salt)
        params = req.sampling_params(ctx.generation_defaults)
        tools, schema, forced_name = req.tool_schema()
        forced = schema is not None
        parse_calls = forced or (bool(tools) and req.tool_choice in (None, "auto"))
        if tools and req.tool_choice in (None, "auto") and not (self.auto_tools and self.tool_parser is not None):
            raise invalid("tool_choice 'auto' (the default with tools) needs the server flags "
                          "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
        messages = req.template_messages()
        options = {**req.template_options(), "add_special_tokens": req.add_special_tokens}
        streams = await ctx.start([None], params, messages, req.add_generation_prompt, template_options=options,
                                  lora_request=lora)
        stream = streams[0]
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name(req.model)
        num_top = params.logprobs
        tool_mode = (self.tool_parser if not forced else None, forced, forced_name) if parse_calls else None
        if req.stream:
            chunks = self._chunks(stream, rid, created, model, params.n, num_top, req.include_usage, tool_mode,
                                  req.prompt_logprobs is not None, bool(req.return_token_ids))
            return EventStream(events(chunks, in_band), stream.abort)
        finals = await ctx.finals(request, streams)
        if finals is None:
            return Response(status_code=499)
        raise_if_failed(finals)
        out = finals[0]
        choices = []
        for c in out.outputs:
            logprobs = None
            if num_top is not None:
                logprobs = {"content": chat_logprobs(c.records or [], stream)}
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.finish_reason
            if tool_mode is not None:
                tracker = ToolCallStream(*tool_mode)
                sent = tracker.feed(c.text)
                rest, calls = tracker.finish()
                if calls:
                    message = {"role": "assistant", "content": (sent + rest).strip() or None,
                               "tool_calls": [call.to_openai() for call in calls]}
                    finish = "tool_calls" if finish == "stop" else finish
            choice = {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                      "stop_reason": c.stop_reason}
            if req.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
                "usage": ctx.usage([out])}
        if req.return_token_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_token_ids, out.prompt_records,
                                                           stream.token_texts)
        return JSONResponse(body)

    async def _chunks(self, stream, rid, created, model, n, num_top, include_usage, tool_mode=None,
                      prompt_logprobs=False, token_ids=False):
        """Streamed chat; with ``token_ids`` (vLLM's ``return_token_ids``) the first chunk carries the
        ``prompt_token_ids`` and every choice chunk its new ``token_ids``."""
        tracker = ChoiceTracker(num_top)
        prompt_sent = not prompt_logprobs  # vLLM's prompt_logprobs go in the first chunk after the prompt ran
        tool_streams = {i: ToolCallStream(*tool_mode) for i in range(n)} if tool_mode is not None else {}
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        final = None

        def chunk(choice: dict, **extra) -> dict:
            c = {**base, "choices": [choice], **extra}
            if include_usage:
                c["usage"] = None
            return c

        for i in range(n):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
            if token_ids and i == 0:  # vLLM's: the prompt's ids with the first chunk ever
                yield chunk(first, prompt_token_ids=list(stream.prompt_token_ids))
            else:
                yield chunk(first)
        async for out in stream:
            if out.finished:
                final = out
            if not prompt_sent and out.prompt_records is not None:
                prompt_sent = True
                plp = vllm_prompt_logprobs(out.prompt_token_ids, out.prompt_records, stream.token_texts)
                yield {**base, "choices": [], "prompt_logprobs": plp}
            for ev in tracker.events(out):
                text, finish = ev.text, ev.finish_reason
                delta = {}
                if ev.index in tool_streams:  # content up to a tool call's start; the calls at the end
                    ts = tool_streams[ev.index]
                    text = ts.feed(ev.text)
                    if finish is not None:
                        rest, calls = ts.finish()
                        text += rest
                        if calls:
                            delta["tool_calls"] = [call.to_openai(k) for k, call in enumerate(calls)]
                            finish = "tool_calls" if finish == "stop" else finish
                if text or finish is None:
                    delta["content"] = text
                logprobs = {"content": chat_logprobs(ev.logprobs, stream)} if ev.logprobs is not None else None
                choice = {"index": ev.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                if ev.finish_reason is not None:
                    choice["stop_reason"] = ev.stop_reason
                if token_ids:
                    choice["token_ids"] = list(ev.token_ids)
                yield chunk(choice)
        if include_usage and final is not None:
            yield {**base, "choices": [], "usage": self.ctx.usage([final])}
