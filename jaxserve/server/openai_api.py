"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health and metrics.

Streaming responses are server-sent events ending in ``data: [DONE]``. A client that disconnects (streaming or
not) aborts its request, which frees its KV pages before the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.engine.request_stream import RequestStream
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestDelta, RequestOutput, TokenRecord
from jaxserve.server.asgi import wait_disconnect
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.intake import (
    FILLER_LOGPROB,
    ChoiceTracker,
    RequestError,
    api_key_ok,
    check_model,
    from_engine_error,
    internal_error,
    invalid,
    unauthenticated,
    usage_counts,
)
from jaxserve.server.limits import RequestLimits
from jaxserve.server.metrics import CONTENT_TYPE, ServerMetrics
from jaxserve.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    decode_json,
    parse,
)
from jaxserve.server.tool_calls import ToolCallStream, make_parser

logger = logging.getLogger(__name__)

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of ``bytes``; ``on_close`` runs however the response ends
    (finished, client disconnected, or failed), so unfinished requests are aborted at once."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(status_code=200)
        self.events = events
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        streamer = asyncio.ensure_future(stream())
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.on_close()
            for task in (streamer, watcher):
                task.cancel()
            results = await asyncio.gather(streamer, watcher, return_exceptions=True)
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):
            logger.error("streaming a response failed", exc_info=error)


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _usage(outs: list[RequestOutput]) -> dict[str, Any]:
    counts = [usage_counts(o) for o in outs]
    prompt = sum(c["prompt_tokens"] for c in counts)
    completion = sum(c["completion_tokens"] for c in counts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(c["cached_tokens"] for c in counts)}}


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput | RequestDelta]]:
    """(prompt index, output) from several streams as they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, s: RequestStream):
        try:
            async for out in s:
                q.put_nowait((k, out))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            q.put_nowait((k, e))
        q.put_nowait((k, None))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            k, out = await q.get()
            if out is None:
                remaining -= 1
            elif isinstance(out, Exception):
                raise out
            else:
                yield k, out
    finally:
        for t in tasks:
            t.cancel()


class _InternalErrors:
    """ASGI middleware: an exception no handler took becomes a 500 that shows only an error id (the log gets
    the traceback, once), instead of Starlette's handler-then-reraise, which logs it twice."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # noqa: BLE001 - the one place unexpected failures end up
            err = internal_error(e, f"{scope.get('method')} {scope.get('path')} request")
            self.metrics.rejected.labels("http", err.reason).inc()
            if not started:
                await JSONResponse(err.to_openai(), status_code=500)(scope, receive, send)


def _body(model) -> dict:
    """``openapi_extra`` declaring a JSON request body of ``model``'s schema (the handlers read the raw body)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


class OpenAIServer:
    """Builds the FastAPI app over an ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, served_model_names: list[str], *,
                 api_key: str | None = None, max_body_bytes: int = 4 * 2**20, limits: RequestLimits | None = None,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None):
        self.engine = engine
        self.auto_tools = enable_auto_tool_choice
        self.tool_parser = make_parser(tool_call_parser)
        self.metrics = metrics
        self.names = served_model_names
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.limits = limits or RequestLimits()
        self.created = int(time.time())

    def app(self) -> FastAPI:
        app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
        app.add_exception_handler(RequestError, self._request_error)
        app.add_exception_handler(StarletteHTTPException, self._http_error)
        app.add_middleware(_InternalErrors, metrics=self.metrics)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/live", self.live, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_endpoint, methods=["GET"])
        auth = [Depends(self._authorize)]
        v1 = APIRouter(prefix="/v1", dependencies=auth)
        v1.add_api_route("/models", self.models, methods=["GET"])
        # Control endpoints (weights, adapters, sleep) are left out of the published OpenAPI schema, as vLLM's
        # are: they change what the server serves, which is no part of the OpenAI API.
        control = dict(methods=["POST"], include_in_schema=False)
        v1.add_api_route("/update_weights", self.update_weights, **control)
        v1.add_api_route("/load_lora_adapter", self.load_lora_adapter, **control)
        v1.add_api_route("/unload_lora_adapter", self.unload_lora_adapter, **control)
        v1.add_api_route("/completions", self.completions, methods=["POST"], openapi_extra=_body(CompletionRequest))
        v1.add_api_route("/chat/completions", self.chat_completions, methods=["POST"],
                         openapi_extra=_body(ChatCompletionRequest))
        app.include_router(v1)
        tokens = APIRouter(dependencies=auth)
        tokens.add_api_route("/tokenize", self.tokenize, methods=["POST"], openapi_extra=_body(TokenizeRequest))
        tokens.add_api_route("/detokenize", self.detokenize, methods=["POST"], openapi_extra=_body(DetokenizeRequest))
        # vLLM's sleep endpoints
        tokens.add_api_route("/sleep", self.sleep, **control)
        tokens.add_api_route("/wake_up", self.wake_up, **control)
        tokens.add_api_route("/is_sleeping", self.is_sleeping, methods=["GET"], include_in_schema=False)
        app.include_router(tokens)
        app.openapi = lambda: self._openapi(app)
        return app

    def _openapi(self, app: FastAPI) -> dict:
        """FastAPI's schema plus the request bodies the handlers parse themselves."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title="jaxserve", version="1", routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    # Errors -------------------------------------------------------------------------------------------------
    async def _request_error(self, request: Request, e: RequestError) -> JSONResponse:
        self.metrics.rejected.labels("http", e.reason).inc()
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.to_openai(), status_code=e.status, headers=headers)

    async def _http_error(self, request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, e.detail)
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": e.status_code}}, status_code=e.status_code)

    async def _authorize(self, request: Request) -> None:
        if not api_key_ok(request.headers.get("authorization"), self.api_key):
            raise unauthenticated()

    async def _read_json(self, request: Request) -> Any:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise invalid(f"the request body has {declared} bytes, over the limit of {self.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise invalid(f"the request body is over the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
        return decode_json(b"".join(chunks))

    # Plain endpoints ----------------------------------------------------------------------------------------
    async def health(self) -> Response:
        if self.engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not self.engine.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        reason = self.engine.unready_reason()
        if reason is not None:
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def live(self) -> Response:
        """Liveness (a Kubernetes liveness probe): 200 while the process answers, whether or not it is ready."""
        return JSONResponse({"status": "live"})

    async def metrics_endpoint(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self) -> JSONResponse:
        """The served names, then the loaded LoRA adapters (vLLM's entries: ``root`` the adapter's folder,
        ``parent`` the base model's name)."""
        info = self.engine.info
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "jaxserve",
             "root": info.get("model_path"), "parent": None, "max_model_len": info.get("max_model_len")}
            for name in self.names] + [
            {"id": lora.lora_name, "object": "model", "created": self.created, "owned_by": "jaxserve",
             "root": lora.lora_path, "parent": self.names[0], "max_model_len": info.get("max_model_len")}
            for lora in self.engine.loras.values()]})

    # LoRA adapters ------------------------------------------------------------------------------------------
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/load_lora_adapter`` with ``{"lora_name", "lora_path"}``: the adapter is read and
        checked now, then selectable by its name in ``model``."""
        body = await self._read_json(request)
        body = body if isinstance(body, dict) else {}
        name, path = body.get("lora_name"), body.get("lora_path")
        for field, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise invalid(f"{field} must be a non-empty string", field)
        if name in self.names:
            raise invalid(f"lora_name: {name!r} is the base model's name", "lora_name")
        try:
            await self.engine.load_lora(LoRARequest(name, self._next_lora_id(), path))
        except Exception as e:  # noqa: BLE001 - mapped to the error response
            err = from_engine_error(e)
            if err.status == 400 and not err.param:
                err.param = "lora_path"
            raise err from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/unload_lora_adapter`` with ``{"lora_name"}``; 404 if no such adapter is loaded."""
        body = await self._read_json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise invalid("lora_name must be a non-empty string", "lora_name")
        if name not in self.engine.loras:
            return JSONResponse({"error": {"message": f"The lora adapter '{name}' cannot be found.",
                                           "type": "NotFoundError", "param": "lora_name", "code": 404}},
                                status_code=404)
        try:
            await self.engine.unload_lora(name)
        except Exception as e:  # noqa: BLE001
            raise from_engine_error(e) from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    def _next_lora_id(self) -> int:
        return max((lora.lora_int_id for lora in self.engine.loras.values()), default=0) + 1

    # Tokens -------------------------------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``/tokenize``: the token ids of a prompt (``prompt``) or of a conversation in the chat
        template (``messages``), as generation would see them."""
        req: TokenizeRequest = parse(TokenizeRequest, await self._read_json(request))
        self._lora_for(req.model)
        messages = req.template_messages()
        try:
            ids = await self.engine.tokenize_prompt(req.prompt, messages, req.add_generation_prompt,
                                                    template_options=req.template_options(),
                                                    add_special_tokens=req.special_tokens())
            strs = await self.engine.token_pieces(ids) if req.return_token_strs else None
        except Exception as e:  # noqa: BLE001 - mapped to the error response
            raise from_engine_error(e) from None
        return JSONResponse({"count": len(ids), "max_model_len": self.engine.info.get("max_model_len"),
                             "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``/detokenize``: the text of token ids."""
        req: DetokenizeRequest = parse(DetokenizeRequest, await self._read_json(request))
        self._lora_for(req.model)
        try:
            text = await self.engine.detokenize(req.tokens)
        except Exception as e:  # noqa: BLE001
            raise from_engine_error(e) from None
        return JSONResponse({"prompt": text})

    # Sleep and live weights ---------------------------------------------------------------------------------
    async def sleep(self, request: Request) -> JSONResponse:
        """vLLM's ``POST /sleep?level=1``: refuse new requests (503), wait for the running ones, then free the KV
        cache (level 1) or the weights too (level 2) until ``POST /wake_up``."""
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise invalid(f"level={level!r} must be 1 (free the KV cache) or 2 (the weights too)", "level")
        try:
            await self.engine.sleep(int(level))
        except Exception as e:  # noqa: BLE001 - mapped to the error response
            raise from_engine_error(e) from None
        return JSONResponse({"is_sleeping": True, "level": int(level)})

    async def wake_up(self) -> JSONResponse:
        """vLLM's ``POST /wake_up``: the memory back, requests served again."""
        try:
            await self.engine.wake_up()
        except Exception as e:  # noqa: BLE001
            raise from_engine_error(e) from None
        return JSONResponse({"is_sleeping": False})

    async def is_sleeping(self) -> JSONResponse:
        return JSONResponse({"is_sleeping": self.engine.sleeping})

    async def update_weights(self, request: Request) -> JSONResponse:
        """``POST /v1/update_weights`` with ``{"path": folder}``: the checkpoint folder's weights (the served
        architecture and shapes) are read onto the mesh while serving goes on, then swapped in between two steps
        with no compile; the prefix cache is dropped. Requests running meanwhile finish with the KV they have."""
        body = await self._read_json(request)
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise invalid("path must be a checkpoint folder on the server (a string)", "path")
        if not Path(path).is_dir():
            raise invalid(f"path: {path} is not a folder on the server", "path")
        start = time.perf_counter()
        try:
            await self.engine.update_weights(path)
        except Exception as e:  # noqa: BLE001 - mapped to the error response
            err = from_engine_error(e)
            if err.status == 400 and not err.param:
                err.param = "path"
            raise err from None
        return JSONResponse({"status": "ok", "path": path, "seconds": round(time.perf_counter() - start, 3)})

    # Generation ---------------------------------------------------------------------------------------------
    async def _start(self, prompts: list, params, messages=None, add_generation_prompt=True,
                     **prompt_options) -> list[RequestStream]:
        """Admit every prompt of the request, or none (the admitted ones are aborted if one fails).
        ``prompt_options``: ``template_options`` of a chat, ``add_special_tokens`` of a text prompt, the
        ``lora_request`` of an adapter the ``model`` field named."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                try:
                    streams.append(await self.engine.add_request(prompt, params, messages=messages,
                                                                 add_generation_prompt=add_generation_prompt,
                                                                 **prompt_options))
                except Exception as e:  # noqa: BLE001 - mapped to the error response
                    err = from_engine_error(e)
                    if len(prompts) > 1 and err.status == 400:
                        err.message = f"prompt[{i}]: {err.message}"
                    raise err from None
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    async def _until_disconnect(self, request: Request, work, streams: list[RequestStream]):
        """Await ``work``; if the client disconnects first, abort the requests and return None."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(wait_disconnect(request.receive))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                for s in streams:
                    s.abort()
                task.cancel()
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        if task.cancelled():
            await asyncio.gather(task, return_exceptions=True)
            return None
        return task.result()

    @staticmethod
    async def _final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for k, out in _merged(streams):
            if out.finished:
                finals[k] = out
        return finals  # type: ignore[return-value]

    @property
    def _generation_defaults(self) -> dict:
        """The checkpoint's sampling defaults (``--generation-config``), for the fields a request leaves unset."""
        return self.engine.info.get("generation_defaults") or {}

    def _model_name(self, requested: str | None) -> str:
        return requested or self.names[0]

    def _lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter the ``model`` field names (None: the base model); 400 naming ``model`` if it is neither a
        served name nor a loaded adapter."""
        if model is None or model in self.names:
            return None
        lora = self.engine.loras.get(model)
        if lora is None:
            check_model(model, self.names + list(self.engine.loras))
        return lora

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = parse(CompletionRequest, await self._read_json(request))
        lora = self._lora_for(req.model)
        num_prompts = len(req.prompt) if isinstance(req.prompt, list) and req.prompt and not isinstance(
            req.prompt[0], int) else 1
        self.limits.check(n=req.n, best_of=req.best_of, logprobs=req.logprobs, stop=req.stop,
                          stop_token_ids=req.stop_token_ids, num_prompts=num_prompts)
        if req.prompt_logprobs is not None:
            self.limits.check(logprobs=req.prompt_logprobs, logprobs_field="prompt_logprobs")
        params = req.sampling_params(self._generation_defaults)
        prompts = req.prompts()
        streams = await self._start(prompts, params, add_special_tokens=req.add_special_tokens, lora_request=lora)
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self._model_name(req.model)
        n, num_top = req.n, req.logprobs
        if req.stream:
            echo = None
            if req.echo:
                echo = [p if isinstance(p, str) else await self.engine.detokenize(p) for p in prompts]
            events = self._completion_events(streams, rid, created, model, n, num_top, req.include_usage, echo,
                                             req.prompt_only, req.prompt_logprobs is not None,
                                             bool(req.return_token_ids))
            return EventStreamResponse(events, lambda: [s.abort() for s in streams])
        finals = await self._until_disconnect(request, self._final_outputs(streams), streams)
        if finals is None:
            return Response(status_code=499)
        _raise_if_failed(finals)
        choices = []
        for k, (stream, out, prompt) in enumerate(zip(streams, finals, prompts)):
            echo = ""
            if req.echo:
                echo = prompt if isinstance(prompt, str) else await self.engine.detokenize(out.prompt_token_ids)
            kept = _best(out.outputs, n) if req.best_of_extra else out.outputs
            for j, c in enumerate(kept):
                logprobs = None
                if num_top is not None:
                    records = [] if req.prompt_only else c.records or []
                    logprobs = _completion_logprobs(records, stream.token_texts, len(echo))[0]
                    if req.echo:
                        logprobs = _echo_logprobs(out.prompt_token_ids, out.prompt_records, num_top,
                                                  stream.token_texts, logprobs)
                choice = {"index": k * n + j, "text": echo + ("" if req.prompt_only else c.text),
                          "logprobs": logprobs, "finish_reason": "length" if req.prompt_only else c.finish_reason,
                          "stop_reason": None if req.prompt_only else c.stop_reason}
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = [] if req.prompt_only else list(c.token_ids)
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _vllm_prompt_logprobs(out.prompt_token_ids, out.prompt_records,
                                                                      stream.token_texts)
                choices.append(choice)
        usage = _usage(finals)
        if req.prompt_only:
            usage["total_tokens"] -= usage["completion_tokens"]
            usage["completion_tokens"] = 0
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": usage})

    async def _completion_events(self, streams, rid, created, model, n, num_top, include_usage, echo=None,
                                 prompt_only=False, prompt_logprobs=False, token_ids=False):
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
        try:
            async for k, out in _merged(streams):
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
                        logprobs, offsets[index] = _completion_logprobs(
                            [] if prompt_only else ev.logprobs, texts, offsets.get(index, 0) + len(prefix))
                        if prefix or (echo is not None and first):
                            logprobs = _echo_logprobs(out.prompt_token_ids, scored.get(k), num_top, texts, logprobs)
                    finish = "length" if prompt_only and ev.finish_reason else ev.finish_reason
                    choice = {"index": index, "text": prefix + ("" if prompt_only else ev.text),
                              "logprobs": logprobs, "finish_reason": finish}
                    if ev.finish_reason is not None:
                        choice["stop_reason"] = None if prompt_only else ev.stop_reason
                    if prompt_logprobs and first:
                        choice["prompt_logprobs"] = _vllm_prompt_logprobs(out.prompt_token_ids, scored.get(k), texts)
                    if token_ids:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids) if first else None
                        choice["token_ids"] = [] if prompt_only else list(ev.token_ids)
                    chunk = {**base, "choices": [choice]}
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
            if include_usage:
                usage = _usage([f for f in finals if f is not None])
                if prompt_only:
                    usage["total_tokens"] -= usage["completion_tokens"]
                    usage["completion_tokens"] = 0
                yield _sse({**base, "choices": [], "usage": usage})
        except Exception as e:  # noqa: BLE001 - the status line is already sent; report in-band
            err = from_engine_error(e)
            yield _sse(err.to_openai())
        yield _sse("[DONE]")

    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await self._read_json(request))
        lora = self._lora_for(req.model)
        self.limits.check(n=req.n, logprobs=req.top_logprobs, stop=req.stop, stop_token_ids=req.stop_token_ids,
                          logprobs_field="top_logprobs")
        if req.prompt_logprobs is not None:
            self.limits.check(logprobs=req.prompt_logprobs, logprobs_field="prompt_logprobs")
        params = req.sampling_params(self._generation_defaults)
        tools, schema, forced_name = req.tool_schema()
        forced = schema is not None
        parse_calls = forced or (bool(tools) and req.tool_choice in (None, "auto"))
        if tools and req.tool_choice in (None, "auto") and not (self.auto_tools and self.tool_parser is not None):
            raise invalid("tool_choice 'auto' (the default with tools) needs the server flags "
                          "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
        messages = req.template_messages()
        options = {**req.template_options(), "add_special_tokens": req.add_special_tokens}
        streams = await self._start([None], params, messages, req.add_generation_prompt, template_options=options,
                                    lora_request=lora)
        stream = streams[0]
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self._model_name(req.model)
        num_top = params.logprobs
        tool_mode = (self.tool_parser if not forced else None, forced, forced_name) if parse_calls else None
        if req.stream:
            events = self._chat_events(stream, rid, created, model, params.n, num_top, req.include_usage, tool_mode,
                                       req.prompt_logprobs is not None, bool(req.return_token_ids))
            return EventStreamResponse(events, stream.abort)
        finals = await self._until_disconnect(request, self._final_outputs(streams), streams)
        if finals is None:
            return Response(status_code=499)
        _raise_if_failed(finals)
        out = finals[0]
        choices = []
        for c in out.outputs:
            logprobs = None
            if num_top is not None:
                logprobs = {"content": _chat_logprobs(c.records or [], stream)}
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
                "usage": _usage([out])}
        if req.return_token_ids:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = _vllm_prompt_logprobs(out.prompt_token_ids, out.prompt_records,
                                                            stream.token_texts)
        return JSONResponse(body)

    async def _chat_events(self, stream, rid, created, model, n, num_top, include_usage, tool_mode=None,
                           prompt_logprobs=False, token_ids=False):
        """Streamed chat; with ``token_ids`` (vLLM's ``return_token_ids``) the first chunk carries the
        ``prompt_token_ids`` and every choice chunk its new ``token_ids``."""
        tracker = ChoiceTracker(num_top)
        prompt_sent = not prompt_logprobs  # vLLM's prompt_logprobs go in the first chunk after the prompt ran
        tool_streams = {i: ToolCallStream(*tool_mode) for i in range(n)} if tool_mode is not None else {}
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        final = None

        def chunk(choice: dict) -> bytes:
            c = {**base, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return _sse(c)

        try:
            for i in range(n):
                first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                if token_ids and i == 0:  # vLLM's: the prompt's ids with the first chunk ever
                    c = {**base, "choices": [first], "prompt_token_ids": list(stream.prompt_token_ids)}
                    if include_usage:
                        c["usage"] = None
                    yield _sse(c)
                else:
                    yield chunk(first)
            async for out in stream:
                if out.finished:
                    final = out
                if not prompt_sent and out.prompt_records is not None:
                    prompt_sent = True
                    plp = _vllm_prompt_logprobs(out.prompt_token_ids, out.prompt_records, stream.token_texts)
                    yield _sse({**base, "choices": [], "prompt_logprobs": plp})
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
                    logprobs = ({"content": _chat_logprobs(ev.logprobs, stream)}
                                if ev.logprobs is not None else None)
                    choice = {"index": ev.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                    if ev.finish_reason is not None:
                        choice["stop_reason"] = ev.stop_reason
                    if token_ids:
                        choice["token_ids"] = list(ev.token_ids)
                    yield chunk(choice)
            if include_usage and final is not None:
                yield _sse({**base, "choices": [], "usage": _usage([final])})
        except Exception as e:  # noqa: BLE001 - the status line is already sent; report in-band
            yield _sse(from_engine_error(e).to_openai())
        yield _sse("[DONE]")


def _best(outputs: list, n: int) -> list:
    """``best_of``: the n outputs of highest cumulative logprob."""
    def score(c) -> float:
        return sum(r.logprob for r in (c.records or ()) if r.logprob is not None)
    return sorted(outputs, key=score, reverse=True)[:n]


def _echo_logprobs(prompt_ids: list[int], records: list[TokenRecord | None] | None, num_top: int,
                   texts: dict[int, str], generated: dict) -> dict:
    """Completions' logprobs with ``echo``: the prompt's tokens first (the first with no logprob), each with the
    top ``num_top`` of its record, then the generated ones (``generated``, their offsets already past the
    prompt text)."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for token, record in zip(prompt_ids, records or [None] * len(prompt_ids)):
        text = texts.get(token, "")
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if record is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(record.logprob)
        top.append({texts.get(t, ""): v for t, v in record.top[:num_top]})
    return {"tokens": tokens + generated["tokens"], "token_logprobs": token_logprobs + generated["token_logprobs"],
            "top_logprobs": top + generated["top_logprobs"], "text_offset": offsets + generated["text_offset"]}


def _vllm_prompt_logprobs(prompt_ids: list[int], records: list[TokenRecord | None] | None,
                          texts: dict[int, str]) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token (None for the first) ``{token id: {logprob, rank,
    decoded_token}}``, the prompt token first, then the top-n (rank: 1 is the most likely; the prompt token's
    is None when it is not among the top-n)."""
    if records is None:
        return None
    result: list[dict | None] = []
    for token, record in zip(prompt_ids, records):
        if record is None:
            result.append(None)
            continue
        entry = {str(token): {"logprob": record.logprob, "rank": record.rank, "decoded_token": texts.get(token, "")}}
        for rank, (t, v) in enumerate(record.top, 1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": texts.get(t, "")})
        result.append(entry)
    return result


def _completion_logprobs(records: list[TokenRecord], texts: dict[int, str], offset: int) -> tuple[dict, int]:
    """OpenAI's completions ``logprobs`` of generated tokens, from ``text_offset`` ``offset`` on; returns them and
    the offset past their text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for r in records:
        text = texts.get(r.id, "")
        tokens.append(text)
        token_logprobs.append(r.logprob if r.logprob is not None else FILLER_LOGPROB)
        top.append({texts.get(t, ""): v for t, v in r.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}, offset


def _chat_logprobs(records: list[TokenRecord], stream: RequestStream) -> list[dict]:
    """OpenAI's chat logprobs; ``bytes`` are each token's own raw bytes (a token that holds part of a UTF-8
    character shows its bytes, not the replacement character its text decodes to)."""
    texts, raw = stream.token_texts, stream.token_bytes

    def entry(token_id: int, logprob: float) -> dict:
        text = texts.get(token_id, "")
        return {"token": text, "logprob": logprob, "bytes": list(raw.get(token_id, text.encode()))}

    return [{**entry(r.id, r.logprob if r.logprob is not None else FILLER_LOGPROB),
             "top_logprobs": [entry(t, v) for t, v in r.top]} for r in records]


def _raise_if_failed(finals: list[RequestOutput]) -> None:
    """A request whose step failed on the engine is a 500 naming it (the log has the cause; the client gets no
    internal text)."""
    failed = [out.request_id for out in finals if out.error is not None]
    if failed:
        raise RequestError(f"internal error: generation failed for request {', '.join(failed)}; the server log has "
                           "the details", status=500, code=grpc.StatusCode.INTERNAL, type="internal_error",
                           reason="error")
