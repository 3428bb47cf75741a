"""Control routes, which change what the server serves: LoRA adapters (``POST /v1/load_lora_adapter``,
``/v1/unload_lora_adapter``), live weights (``POST /v1/update_weights``) and vLLM's sleep (``POST /sleep``,
``/wake_up``, ``GET /is_sleeping``).

Off unless enabled (``AdminConfig``: ``--enable-admin-endpoints``, or vLLM's ``VLLM_SERVER_DEV_MODE`` /
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` for their own routes): a route that is off is a 404 like any unknown path.
With an admin key they need it (an API key does not open them); the folders they read must lie in the allowed
ones, and a path outside them is refused the same way whether or not it exists; one weight update runs at a
time; the adapters registered at once are capped.

They are left out of the published OpenAPI schema, as vLLM's are: they are no part of the OpenAI API.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.lora_request import LoRARequest
from jaxserve.server.intake import RequestError, conflict, invalid
from jaxserve.server.openai.context import APIContext
from jaxserve.server.openai.errors import engine_errors
from jaxserve.server.openai.streaming import error_body


class Admin:
    """Adapters, weights and sleep, each a call on the engine that may refuse (mapped as any engine error)."""

    bodies = ()

    def __init__(self, ctx: APIContext):
        self.ctx = ctx
        self.config = ctx.admin
        self._updating = False  # a weight update is running
        self._loading = 0  # adapter loads in flight (counted against the cap)

    def router(self) -> APIRouter:
        """The enabled routes only, behind the admin key (the API key's check does not apply: it opens none)."""
        router = APIRouter(dependencies=[Depends(self._authorize)])
        handlers = {"/v1/update_weights": self.update_weights, "/v1/load_lora_adapter": self.load_lora_adapter,
                    "/v1/unload_lora_adapter": self.unload_lora_adapter, "/sleep": self.sleep,
                    "/wake_up": self.wake_up, "/is_sleeping": self.is_sleeping}
        for method, path in self.config.routes():
            router.add_api_route(path, handlers[path], methods=[method], include_in_schema=False)
        return router

    async def _authorize(self, request: Request) -> None:
        if not self.config.authorized(request.headers.get("authorization")):
            raise RequestError("missing or invalid admin key: admin routes need 'Authorization: Bearer "
                               "<admin key>' (--admin-api-key); the API key does not open them", status=401,
                               code=grpc.StatusCode.UNAUTHENTICATED, type="authentication_error",
                               reason="unauthenticated")

    def _allowed(self, path: str, field: str) -> str:
        """``path`` resolved, if it lies in ``--allowed-admin-paths``; else a 400 that says nothing of whether it
        exists."""
        real = self.config.resolve(path)
        if real is None:
            raise invalid(f"{field}: {path!r} is outside the folders admin routes may read "
                          "(--allowed-admin-paths)", field)
        return real

    # LoRA adapters ------------------------------------------------------------------------------------------
    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/load_lora_adapter`` with ``{"lora_name", "lora_path"}``: the adapter is read and
        checked now, then selectable by its name in ``model``."""
        body = await self.ctx.read_json(request)
        body = body if isinstance(body, dict) else {}
        name, path = body.get("lora_name"), body.get("lora_path")
        for field, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise invalid(f"{field} must be a non-empty string", field)
        if name in self.ctx.names:
            raise invalid(f"lora_name: {name!r} is the base model's name", "lora_name")
        real = self._allowed(path, "lora_path")
        cap = self.config.max_cpu_loras
        if name not in self.ctx.engine.loras and len(self.ctx.engine.loras) + self._loading >= cap:
            raise conflict(f"lora_name: {cap} adapters are registered, the limit (--max-cpu-loras); unload one "
                           "first", "lora_name")
        self._loading += 1
        try:
            with engine_errors(param="lora_path"):
                await self.ctx.engine.load_lora(LoRARequest(name, self._next_lora_id(), real))
        finally:
            self._loading -= 1
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's ``POST /v1/unload_lora_adapter`` with ``{"lora_name"}``; 404 if no such adapter is loaded."""
        body = await self.ctx.read_json(request)
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise invalid("lora_name must be a non-empty string", "lora_name")
        if name not in self.ctx.engine.loras:
            return JSONResponse(error_body(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404,
                                           "lora_name"), status_code=404)
        with engine_errors():
            await self.ctx.engine.unload_lora(name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    def _next_lora_id(self) -> int:
        return max((lora.lora_int_id for lora in self.ctx.engine.loras.values()), default=0) + 1

    # Sleep and live weights ---------------------------------------------------------------------------------
    async def sleep(self, request: Request) -> JSONResponse:
        """vLLM's ``POST /sleep?level=1``: refuse new requests (503), wait for the running ones, then free the KV
        cache (level 1) or the weights too (level 2) until ``POST /wake_up``."""
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise invalid(f"level={level!r} must be 1 (free the KV cache) or 2 (the weights too)", "level")
        with engine_errors():
            await self.ctx.engine.sleep(int(level))
        return JSONResponse({"is_sleeping": True, "level": int(level)})

    async def wake_up(self) -> JSONResponse:
        """vLLM's ``POST /wake_up``: the memory back, requests served again."""
        with engine_errors():
            await self.ctx.engine.wake_up()
        return JSONResponse({"is_sleeping": False})

    async def is_sleeping(self) -> JSONResponse:
        return JSONResponse({"is_sleeping": self.ctx.engine.sleeping})

    async def update_weights(self, request: Request) -> JSONResponse:
        """``POST /v1/update_weights`` with ``{"path": folder}``: the checkpoint folder's weights (the served
        architecture and shapes) are read onto the mesh while serving goes on, then swapped in between two steps
        with no compile; the prefix cache is dropped. Requests running meanwhile finish with the KV they have."""
        body = await self.ctx.read_json(request)
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            raise invalid("path must be a checkpoint folder on the server (a string)", "path")
        real = self._allowed(path, "path")
        if not Path(real).is_dir():
            raise invalid(f"path: {path} is not a folder on the server", "path")
        if self._updating:  # each update reads a whole copy of the weights: never two at once
            raise conflict("a weight update is already running; retry when it has finished", "path")
        self._updating = True
        start = time.perf_counter()
        try:
            with engine_errors(param="path"):
                await self.ctx.engine.update_weights(real)
        finally:
            self._updating = False
        return JSONResponse({"status": "ok", "path": path, "seconds": round(time.perf_counter() - start, 3)})
