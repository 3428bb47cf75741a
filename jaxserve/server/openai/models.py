"""``GET /v1/models``: what a request's ``model`` field may name."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from jaxserve.server.openai.context import APIContext


class Models:
    """The served names and the loaded adapters."""

    bodies = ()

    def __init__(self, ctx: APIContext):
        self.ctx = ctx

    def router(self) -> APIRouter:
        router = self.ctx.router("/v1")
        router.add_api_route("/models", self.models, methods=["GET"])
        return router

    async def models(self) -> JSONResponse:
        """The served names, then the loaded LoRA adapters (vLLM's entries: ``root`` the adapter's folder,
        ``parent`` the base model's name)."""
        ctx = self.ctx
        info = ctx.engine.info
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": ctx.created, "owned_by": "jaxserve",
             "root": info.get("model_path"), "parent": None, "max_model_len": info.get("max_model_len")}
            for name in ctx.names] + [
            {"id": lora.lora_name, "object": "model", "created": ctx.created, "owned_by": "jaxserve",
             "root": lora.lora_path, "parent": ctx.names[0], "max_model_len": info.get("max_model_len")}
            for lora in ctx.engine.loras.values()]})
