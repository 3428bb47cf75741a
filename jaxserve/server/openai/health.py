"""Probes and metrics, open without the API key: ``GET /health`` (readiness), ``GET /live`` (liveness),
``GET /metrics`` (Prometheus) and vLLM's ``GET /version``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

import jaxserve
from jaxserve.server.metrics import CONTENT_TYPE
from jaxserve.server.openai.context import APIContext


class Health:
    """The probes a load balancer or Kubernetes asks, and the metrics Prometheus scrapes."""

    bodies = ()

    def __init__(self, ctx: APIContext):
        self.ctx = ctx

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/health", self.health, methods=["GET"])
        router.add_api_route("/live", self.live, methods=["GET"])
        router.add_api_route("/metrics", self.metrics_endpoint, methods=["GET"])
        router.add_api_route("/version", self.version, methods=["GET"])
        return router

    async def health(self) -> Response:
        engine = self.ctx.engine
        if engine.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        reason = engine.unready_reason()
        if reason is not None:
            return JSONResponse({"status": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def live(self) -> Response:
        """Liveness (a Kubernetes liveness probe): 200 while the process answers, whether or not it is ready."""
        return JSONResponse({"status": "live"})

    async def version(self) -> JSONResponse:
        """vLLM's ``GET /version``: ``{"version": ...}``, here jaxserve's."""
        return JSONResponse({"version": jaxserve.__version__})

    async def metrics_endpoint(self) -> Response:
        return Response(self.ctx.metrics.render(), media_type=CONTENT_TYPE)
