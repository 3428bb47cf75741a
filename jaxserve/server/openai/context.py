"""What the endpoint modules share: the engine and the served names, the API key check (and the tenant each key
is), the request body read within its limit, the ``model`` field resolved to the base model or an adapter,
admitting a request's prompts and collecting their outputs, and the ``usage`` of an answer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute

from jaxserve.config.network import SECRET_HEADER, ClusterSecurity
from jaxserve.engine.request_stream import RequestStream
from jaxserve.lora_request import LoRARequest
from jaxserve.outputs import RequestDelta, RequestOutput
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.access import AdminConfig, api_keys, matching_key, matching_token, needs_api_key, tenant_salt
from jaxserve.server.intake import check_model, decode_json, invalid, unauthenticated, usage_counts
from jaxserve.server.limits import RequestLimits
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openai.errors import engine_errors
from jaxserve.server.openai.streaming import until_disconnect


def json_body(model) -> dict:
    """``openapi_extra`` declaring a JSON request body of ``model``'s schema (the handlers read the raw body)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


class APIContext:
    """The server's state as every endpoint module sees it.

    ``api_key``: one key or several (each one a tenant); ``prompt_tokens_details``: report
    ``usage.prompt_tokens_details.cached_tokens`` (``--enable-prompt-tokens-details``); ``cache_salt_per_api_key``:
    each key's requests share prefix-cache pages only with each other; ``admin``: the admin routes served."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, served_model_names: list[str], *,
                 api_key: str | Sequence[str] | None = None, max_body_bytes: int = 4 * 2**20,
                 limits: RequestLimits | None = None, prompt_tokens_details: bool = False,
                 cache_salt_per_api_key: bool = False, admin: AdminConfig | None = None,
                 cluster: ClusterSecurity | None = None):
        self.engine = engine
        self.metrics = metrics
        self.names = served_model_names
        self.api_keys = api_keys(api_key)
        self.cluster = cluster or ClusterSecurity()  # its secret: required with the API key, never instead
        self.max_body_bytes = max_body_bytes
        self.limits = limits or RequestLimits()
        self.prompt_tokens_details = prompt_tokens_details
        self.cache_salt_per_api_key = cache_salt_per_api_key
        self.admin = admin or AdminConfig()
        self.created = int(time.time())

    def router(self, prefix: str = "", *, x_api_key: bool = False,
               route_class: type[APIRoute] = APIRoute) -> APIRouter:
        """A router whose routes need the cluster secret (if the server has one) and, under ``/v1``
        (``access.needs_api_key``, vLLM's rule), the API key. ``x_api_key``: the key may come as ``x-api-key: KEY``
        too (Anthropic's clients send it so); ``route_class``: the routes' class (e.g. one that answers errors in
        another API's shape)."""
        if not needs_api_key(prefix):
            check = self._cluster_member
        else:
            check = self._authorize_x_api_key if x_api_key else self._authorize
        return APIRouter(prefix=prefix, dependencies=[Depends(check)], route_class=route_class)

    async def _cluster_member(self, request: Request) -> None:
        self._check_access(request, api_key=False, x_api_key=False)

    async def _authorize(self, request: Request) -> None:
        self._check_access(request, api_key=True, x_api_key=False)

    async def _authorize_x_api_key(self, request: Request) -> None:
        self._check_access(request, api_key=True, x_api_key=True)

    def _check_access(self, request: Request, api_key: bool, x_api_key: bool) -> None:
        # not a dependency itself: FastAPI would read its parameters from the query string
        if not self.cluster.secret_ok(request.headers.get(SECRET_HEADER)):
            raise unauthenticated(self.cluster.refusal())
        if api_key and self.api_keys:
            key = matching_key(request.headers.get("authorization"), self.api_keys)
            if key is None and x_api_key:
                key = matching_token(request.headers.get("x-api-key"), self.api_keys)
            if key is None and x_api_key:
                raise unauthenticated("missing or invalid API key: send 'x-api-key: <key>' or "
                                      "'Authorization: Bearer <key>'")
            if key is None:
                raise unauthenticated()
            request.state.api_key = key

    def cache_salt(self, request: Request, salt: str | None) -> str | None:
        """The prefix-cache salt a request runs with: its own ``cache_salt``, after its API key's with
        ``--cache-salt-per-api-key``."""
        if not self.cache_salt_per_api_key:
            return salt
        return tenant_salt(getattr(request.state, "api_key", None), salt)

    def usage(self, outs: list[RequestOutput]) -> dict[str, Any]:
        """OpenAI's ``usage`` of the outputs together; ``prompt_tokens_details`` (the prompt tokens the prefix
        cache held) only with ``--enable-prompt-tokens-details``, else null, as vLLM answers."""
        return usage(outs, self.prompt_tokens_details)
    async def read_json(self, request: Request) -> Any:
        """The request's JSON body (``intake.decode_json``'s checks), refused past ``max_body_bytes``."""
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

    @property
    def generation_defaults(self) -> dict:
        """The checkpoint's sampling defaults (``--generation-config``), for the fields a request leaves unset."""
        return self.engine.info.get("generation_defaults") or {}

    def model_name(self, requested: str | None) -> str:
        return requested or self.names[0]

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter the ``model`` field names (None: the base model); vLLM's 404 naming ``model`` if it is
        neither a served name nor a loaded adapter."""
        if model is None or model in self.names:
            return None
        lora = self.engine.loras.get(model)
        if lora is None:
            check_model(model, self.names + list(self.engine.loras))
        return lora

    async def start(self, prompts: list, params, messages=None, add_generation_prompt=True,
                    **prompt_options) -> list[RequestStream]:
        """Admit every prompt of the request, or none (the admitted ones are aborted if one fails).
        ``prompt_options``: ``template_options`` of a chat, ``add_special_tokens`` of a text prompt, the
        ``lora_request`` of an adapter the ``model`` field named."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                with engine_errors(prefix=f"prompt[{i}]: " if len(prompts) > 1 else ""):
                    streams.append(await self.engine.add_request(prompt, params, messages=messages,
                                                                 add_generation_prompt=add_generation_prompt,
                                                                 **prompt_options))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    async def finals(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput] | None:
        """Each stream's final output; None (the requests aborted) if the client goes away first."""
        return await until_disconnect(request.receive, _final_outputs(streams),
                                      on_disconnect=lambda: [s.abort() for s in streams])


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput | RequestDelta]]:
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


async def _final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(streams)
    async for k, out in merged(streams):
        if out.finished:
            finals[k] = out
    return finals  # type: ignore[return-value]


def usage(outs: list[RequestOutput], details: bool = False) -> dict[str, Any]:
    """OpenAI's ``usage`` of the outputs together; with ``details``, ``prompt_tokens_details.cached_tokens``
    (prompt tokens the prefix cache held), else ``prompt_tokens_details`` null: how much of a prompt was cached
    tells whoever sent it that someone sent the same prefix before."""
    counts = [usage_counts(o) for o in outs]
    prompt = sum(c["prompt_tokens"] for c in counts)
    completion = sum(c["completion_tokens"] for c in counts)
    cached = {"cached_tokens": sum(c["cached_tokens"] for c in counts)} if details else None
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": cached}
