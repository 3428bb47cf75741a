"""``POST /v1/chat/completions``: a conversation through the chat template, ``n`` choices, streamed or not, with
a thinking model's reasoning split off (``--reasoning-parser``: vLLM's ``reasoning`` in the message and in the
deltas), tools (the model's calls parsed by ``--tool-call-parser``, or forced by ``tool_choice``), OpenAI's
``logprobs`` and vLLM's ``prompt_logprobs`` and ``return_token_ids``. Each choice's text is read by one
``chat_output.ChoiceOutput``, whole or streamed."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.engine.request_stream import RequestStream
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.intake import ChoiceEvent, ChoiceTracker, invalid
from jaxserve.server.openai.context import APIContext, json_body
from jaxserve.server.openai.errors import in_band, raise_if_failed
from jaxserve.server.openai.logprobs import chat_logprobs, vllm_prompt_logprobs
from jaxserve.server.openai.protocol import ChatCompletionRequest, parse
from jaxserve.server.openai.chat_output import ChoiceOutput, OutputDelta
from jaxserve.server.openai.streaming import EventStream, events
from jaxserve.server.openai.tool_calls import ToolCallStream, make_parser
from jaxserve.text.reasoning import ReasoningParser, make_reasoning_parser, reasoning_first


@dataclasses.dataclass
class ChatRun:
    """A chat request on the engine: its stream, its sampling params, the answer's role, and ``reader()``, which
    gives a fresh ``ChoiceOutput`` (the request's reasoning and tool-call parsers) for each choice."""

    stream: RequestStream
    params: SamplingParams
    role: str
    reader: Callable[[], ChoiceOutput]
    output: RequestOutput | None = None  # the finished output, once ``read_stream`` has seen it
    reasoning: ReasoningParser | None = None  # the request's reasoning parser (None: no split)

    async def reasoning_tokens(self, ctx: APIContext, token_ids: list[int]) -> int:
        """How many of an answer's tokens are its reasoning (its markers included): all of them when the answer
        never started, else the longest prefix whose text the parser reads as no answer yet (by bisection, a
        few decodes)."""
        if self.reasoning is None or not token_ids:
            return 0

        async def split(k: int) -> tuple[str | None, str | None]:
            return self.reasoning.split(await ctx.engine.prompts.decode(token_ids[:k], self.params.skip_special_tokens))

        reasoning, content = await split(len(token_ids))
        if reasoning is None:
            return 0
        if not content:
            return len(token_ids)
        lo, hi = 0, len(token_ids)  # no answer after lo tokens; an answer after hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if (await split(mid))[1] else (mid, hi)
        return lo

    async def final(self, ctx: APIContext, request: Request) -> RequestOutput | None:
        """The finished output of a run answered whole; None if the client went away first (a failed run
        raises)."""
        finals = await ctx.finals(request, [self.stream])
        if finals is None:
            return None
        raise_if_failed(finals)
        return finals[0]

    def read(self, text: str) -> tuple[ChoiceOutput, list[OutputDelta]]:
        """A whole answer's ``text`` through a fresh reader: the reader (its calls) and the deltas it read."""
        parsed = self.reader()
        return parsed, [parsed.feed(text), parsed.finish()]

    async def read_stream(self, parsed: ChoiceOutput) -> AsyncIterator[tuple[OutputDelta, ChoiceEvent | None]]:
        """The first choice's answer as it streams, through ``parsed``: each text's reading with None, then the
        finish's with the event that finished the choice. Afterwards ``output`` is the finished output (None if
        the request was aborted)."""
        tracker = ChoiceTracker(None)
        async for out in self.stream:
            if out.finished:
                self.output = out
            for ev in tracker.events(out):
                yield parsed.feed(ev.text), None
                if ev.finish_reason is not None:
                    yield parsed.finish(), ev


class ChatCompletions:
    """The chat completions API; ``enable_auto_tool_choice`` and ``tool_call_parser`` are the server flags that
    let ``tool_choice`` "auto" parse the model's own calls, ``reasoning_parser`` the one that splits off the
    reasoning."""

    bodies = (ChatCompletionRequest,)

    def __init__(self, ctx: APIContext, *, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, response_role: str = "assistant",
                 structured_in_reasoning: bool = False):
        self.ctx = ctx
        self.response_role = response_role  # --response-role
        self.auto_tools = enable_auto_tool_choice
        self.tool_parser = make_parser(tool_call_parser)
        make_reasoning_parser(reasoning_parser)  # a bad name fails at start-up
        self.reasoning_parser = reasoning_parser
        self.structured_in_reasoning = structured_in_reasoning

    def router(self) -> APIRouter:
        router = self.ctx.router("/v1")
        router.add_api_route("/chat/completions", self.chat_completions, methods=["POST"],
                             openapi_extra=json_body(ChatCompletionRequest))
        return router

    async def start(self, request: Request, req: ChatCompletionRequest) -> ChatRun:
        """Admit a parsed chat request: its limits checked, its sampling params, tools and reasoning parser read,
        its conversation through the template to the engine. The other APIs that answer through the chat
        template (the Messages API) translate their requests into a ``ChatCompletionRequest`` and start here."""
        ctx = self.ctx
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
        reasoning = make_reasoning_parser(self.reasoning_parser, req.chat_template_kwargs)
        if (reasoning is not None or parse_calls) and req.skip_special_tokens is None:
            # the markers are often special tokens: the parsers read them (vLLM's parsers ask the same)
            params = dataclasses.replace(params, skip_special_tokens=False)
        params = reasoning_first(params, reasoning, self.structured_in_reasoning)
        messages = req.template_messages()
        # vLLM's rule: the answer's role is --response-role, or without a generation prompt the last message's
        role = self.response_role if req.add_generation_prompt else messages[-1]["role"]
        options = {**req.template_options(), "add_special_tokens": req.add_special_tokens}
        streams = await ctx.start([None], params, messages, req.add_generation_prompt, template_options=options,
                                  lora_request=lora)
        tool_mode = (self.tool_parser if not forced else None, forced, forced_name, tools) if parse_calls else None

        def reader() -> ChoiceOutput:
            return ChoiceOutput(reasoning, ToolCallStream(*tool_mode) if tool_mode is not None else None)

        return ChatRun(streams[0], params, role, reader, reasoning=reasoning)

    async def chat_completions(self, request: Request) -> Response:
        ctx = self.ctx
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await ctx.read_json(request))
        run = await self.start(request, req)
        stream, params, role, reader = run.stream, run.params, run.role, run.reader
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name(req.model)
        num_top = params.logprobs
        if req.stream:
            chunks = self._chunks(stream, rid, created, model, params.n, num_top, req.include_usage, reader,
                                  req.prompt_logprobs is not None, bool(req.return_token_ids), req.include_reasoning,
                                  role)
            return EventStream(events(chunks, in_band), stream.abort)
        finals = await ctx.finals(request, [stream])
        if finals is None:
            return Response(status_code=499)
        raise_if_failed(finals)
        out = finals[0]
        choices = []
        for c in out.outputs:
            logprobs = None
            if num_top is not None:
                logprobs = {"content": chat_logprobs(c.records or [], stream)}
            parsed = reader()
            parsed.feed(c.text)
            parsed.finish()
            message = parsed.message(req.include_reasoning, role)
            finish = c.finish_reason
            if parsed.calls:
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

    async def _chunks(self, stream, rid, created, model, n, num_top, include_usage, reader,
                      prompt_logprobs=False, token_ids=False, include_reasoning=True, role="assistant"):
        """Streamed chat: each choice's deltas as its ``ChoiceOutput`` reads them (vLLM's ``reasoning``,
        ``content`` and ``tool_calls`` deltas); with ``token_ids`` (vLLM's ``return_token_ids``) the first chunk
        carries the ``prompt_token_ids`` and every choice chunk its new ``token_ids``."""
        tracker = ChoiceTracker(num_top)
        prompt_sent = not prompt_logprobs  # vLLM's prompt_logprobs go in the first chunk after the prompt ran
        readers = {i: reader() for i in range(n)}
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        final = None

        def chunk(choice: dict, **extra) -> dict:
            c = {**base, "choices": [choice], **extra}
            if include_usage:
                c["usage"] = None
            return c

        for i in range(n):
            first = {"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
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
                finish = ev.finish_reason
                parsed = readers[ev.index]
                got = parsed.feed(ev.text)
                if finish is not None:
                    end = parsed.finish()
                    got = OutputDelta(got.content + end.content, got.reasoning + end.reasoning,
                                      got.tool_calls + end.tool_calls)
                    if parsed.calls:
                        finish = "tool_calls" if finish == "stop" else finish
                delta = {}
                if got.reasoning and include_reasoning:
                    delta["reasoning"] = got.reasoning
                if got.content or (finish is None and not delta and not got.tool_calls):
                    delta["content"] = got.content
                if got.tool_calls:
                    delta["tool_calls"] = got.tool_calls
                logprobs = {"content": chat_logprobs(ev.logprobs, stream)} if ev.logprobs is not None else None
                choice = {"index": ev.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                if ev.finish_reason is not None:
                    choice["stop_reason"] = ev.stop_reason
                if token_ids:
                    choice["token_ids"] = list(ev.token_ids)
                yield chunk(choice)
        if include_usage and final is not None:
            yield {**base, "choices": [], "usage": self.ctx.usage([final])}
