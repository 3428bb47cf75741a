"""``POST /v1/completions``: one or several prompts (text or token ids), ``n`` choices each, streamed or not,
with OpenAI's ``echo``, ``best_of`` and ``logprobs`` and vLLM's ``prompt_logprobs`` and ``return_token_ids``."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.outputs import RequestOutput, TokenRecord
from jaxserve.server.intake import ChoiceTracker
from jaxserve.server.openai.context import APIContext, json_body, merged
from jaxserve.server.openai.errors import in_band, raise_if_failed
from jaxserve.server.openai.logprobs import completion_logprobs, echo_logprobs, vllm_prompt_logprobs
from jaxserve.server.openai.protocol import CompletionRequest, parse
from jaxserve.server.openai.streaming import EventStream, events


class Completions:
    """The text completions API."""

    bodies = (CompletionRequest,)

    def __init__(self, ctx: APIContext):
        self.ctx = ctx

    def router(self) -> APIRouter:
        router = self.ctx.router("/v1")
        router.add_api_route("/completions", self.completions, methods=["POST"],
                             openapi_extra=json_body(CompletionRequest))
        return router

    async def completions(self, request: Request) -> Response:
        ctx = self.ctx
        req: CompletionRequest = parse(CompletionRequest, await ctx.read_json(request))
        lora = ctx.lora_for(req.model)
        num_prompts = len(req.prompt) if isinstance(req.prompt, list) and req.prompt and not isinstance(
            req.prompt[0], int) else 1
        ctx.limits.check(n=req.n, best_of=req.best_of, logprobs=req.logprobs, stop=req.stop,
                         stop_token_ids=req.stop_token_ids, num_prompts=num_prompts)
        if req.prompt_logprobs is not None:
            ctx.limits.check(logprobs=req.prompt_logprobs, logprobs_field="prompt_logprobs")
        req.cache_salt = ctx.cache_salt(request, req.cache_salt)
        params = req.sampling_params(ctx.generation_defaults)
        prompts = req.prompts()
        streams = await ctx.start(prompts, params, add_special_tokens=req.add_special_tokens, lora_request=lora)
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name(req.model)
        n, num_top = req.n, req.logprobs
        if req.stream:
            echo = None
            if req.echo:
                echo = [p if isinstance(p, str) else await ctx.engine.detokenize(p) for p in prompts]
            chunks = self._chunks(streams, rid, created, model, n, num_top, req.include_usage, echo, req.prompt_only,
                                  req.prompt_logprobs is not None, bool(req.return_token_ids))
            return EventStream(events(chunks, in_band), lambda: [s.abort() for s in streams])
        finals = await ctx.finals(request, streams)
        if finals is None:
            return Response(status_code=499)
        raise_if_failed(finals)
        choices = []
        for k, (stream, out, prompt) in enumerate(zip(streams, finals, prompts)):
            echo = ""
            if req.echo:
                echo = prompt if isinstance(prompt, str) else await ctx.engine.detokenize(out.prompt_token_ids)
            kept = best(out.outputs, n) if req.best_of_extra else out.outputs
            for j, c in enumerate(kept):
                logprobs = None
                if num_top is not None:
                    records = [] if req.prompt_only else c.records or []
                    logprobs = completion_logprobs(records, stream.token_texts, len(echo))[0]
                    if req.echo:
                        logprobs = echo_logprobs(out.prompt_token_ids, out.prompt_records, num_top,
                                                 stream.token_texts, logprobs)
                choice = {"index": k * n + j, "text": echo + ("" if req.prompt_only else c.text),
                          "logprobs": logprobs, "finish_reason": "length" if req.prompt_only else c.finish_reason,
                          "stop_reason": None if req.prompt_only else c.stop_reason}
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = [] if req.prompt_only else list(c.token_ids)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_token_ids, out.prompt_records,
                                                                     stream.token_texts)
                choices.append(choice)
        total = ctx.usage(finals)
        if req.prompt_only:
            total["total_tokens"] -= total["completion_tokens"]
            total["completion_tokens"] = 0
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": total})

    async def _chunks(self, streams, rid, created, model, n, num_top, include_usage, echo=None, prompt_only=False,
                      prompt_logprobs=False, token_ids=False):
        """Streamed completions; with ``echo`` (each prompt's text) a choice's first chunk starts with its prompt
        (and the prompt's logprobs); ``prompt_only`` (max_tokens 0) drops the one generated token; vLLM's
        ``prompt_logprobs`` ride in each choice's first chunk; with ``token_ids`` (vLLM's ``return_token_ids``)
        every chunk carries its new ``token_ids`` and a choice's first chunk the ``prompt_token_ids``."""
        trackers = [ChoiceTracker(num_top) for _ in streams]
        offsets: dict[int, int] = {}
        started: set[int] = set()
        finals: list[RequestOutput | None] = [None] * len(streams)
        scored: dict[int, list[TokenRecord | None]] = {}  # each prompt's records (its first output brings them)
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        async for k, out in merged(streams):
            if out.finished:
                finals[k] = out
            if out.prompt_records is not None:
                scored.setdefault(k, out.prompt_records)
            for ev in trackers[k].events(out):
                index = k * n + ev.index
                first, texts = index not in started, streams[k].token_texts
                started.add(index)
                prefix = echo[k] if echo is not None and first else ""
                logprobs = None
                if ev.logprobs is not None:
                    logprobs, offsets[index] = completion_logprobs(
                        [] if prompt_only else ev.logprobs, texts, offsets.get(index, 0) + len(prefix))
                    if prefix or (echo is not None and first):
                        logprobs = echo_logprobs(out.prompt_token_ids, scored.get(k), num_top, texts, logprobs)
                finish = "length" if prompt_only and ev.finish_reason else ev.finish_reason
                choice = {"index": index, "text": prefix + ("" if prompt_only else ev.text),
                          "logprobs": logprobs, "finish_reason": finish}
                if ev.finish_reason is not None:
                    choice["stop_reason"] = None if prompt_only else ev.stop_reason
                if prompt_logprobs and first:
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_token_ids, scored.get(k), texts)
                if token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids) if first else None
                    choice["token_ids"] = [] if prompt_only else list(ev.token_ids)
                chunk = {**base, "choices": [choice]}
                if include_usage:
                    chunk["usage"] = None
                yield chunk
        if include_usage:
            total = self.ctx.usage([f for f in finals if f is not None])
            if prompt_only:
                total["total_tokens"] -= total["completion_tokens"]
                total["completion_tokens"] = 0
            yield {**base, "choices": [], "usage": total}


def best(outputs: list, n: int) -> list:
    """``best_of``: the n outputs of highest cumulative logprob."""
    def score(c) -> float:
        return sum(r.logprob for r in (c.records or ()) if r.logprob is not None)
    return sorted(outputs, key=score, reverse=True)[:n]
