"""Control routes, which change what the server serves: LoRA adapters (``POST /v1/load_lora_adapter``,
``/v1/unload_lora_adapter``), live weights (``POST /v1/update_weights``) and vLLM's sleep (``POST /sleep``,
``/wake_up``, ``GET /is_sleeping``).

They are left out of the published OpenAPI schema, as vLLM's are: they are no part of the OpenAI API.
"""

from __future__ import annotations

import time
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.lora_request import LoRARequest
from jaxserve.server.intake import invalid
from jaxserve.server.openai.context import APIContext
from jaxserve.server.openai.errors import engine_errors
from jaxserve.server.openai.streaming import error_body


class Admin:
    """Adapters, weights and sleep, each a call on the engine that may refuse (mapped as any engine error)."""

    bodies = ()

    def __init__(self, ctx: APIContext):
        self.ctx = ctx

    def router(self) -> APIRouter:
        router = self.ctx.router()
        control = dict(methods=["POST"], include_in_schema=False)
        router.add_api_route("/v1/update_weights", self.update_weights, **control)
        router.add_api_route("/v1/load_lora_adapter", self.load_lora_adapter, **control)
        router.add_api_route("/v1/unload_lora_adapter", self.unload_lora_adapter, **control)
        router.add_api_route("/sleep", self.sleep, **control)
        router.add_api_route("/wake_up", self.wake_up, **control)
        router.add_api_route("/is_sleeping", self.is_sleeping, methods=["GET"], include_in_schema=False)
        return router

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
        with engine_errors(param="lora_path"):
            await self.ctx.engine.load_lora(LoRARequest(name, self._next_lora_id(), path))
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
        if not Path(path).is_dir():
            raise invalid(f"path: {path} is not a folder on the server", "path")
        start = time.perf_counter()
        with engine_errors(param="path"):
            await self.ctx.engine.update_weights(path)
        return JSONResponse({"status": "ok", "path": path, "seconds": round(time.perf_counter() - start, 3)})
