"""Failures as OpenAI error responses, in one place for every route: what the engine raises, as the
``RequestError`` it answers (``intake.from_engine_error``: status, type, param); a refused request, a missing
route and an unexpected failure as their JSON responses; a failure mid-stream as its in-band event. The
Messages API's routes answer the same failures in Anthropic's shape (``anthropic_route``).

The router, which runs no engine, shares only the error body's shape (``streaming.error_body``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxserve.outputs import RequestOutput
from jaxserve.server.intake import RequestError, from_engine_error, internal_error
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openai.streaming import error_body


@contextlib.contextmanager
def engine_errors(param: str | None = None, prefix: str = "") -> Iterator[None]:
    """Whatever the engine raises in the block leaves it as the ``RequestError`` it maps to; ``param`` names the
    field a 400 that names none is about, ``prefix`` goes before a 400's message (e.g. which prompt)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - mapped to the error response
        err = from_engine_error(e)
        if err.status == 400:
            if param is not None and not err.param:
                err.param = param
            err.message = prefix + err.message
        raise err from None


def in_band(e: Exception) -> dict:
    """The ``error`` event of a stream that failed after its status line went out."""
    return from_engine_error(e).to_openai()


def raise_if_failed(finals: list[RequestOutput]) -> None:
    """A request whose step failed on the engine is a 500 naming it (the log has the cause; the client gets no
    internal text)."""
    failed = [out.request_id for out in finals if out.error is not None]
    if failed:
        raise RequestError(f"internal error: generation failed for request {', '.join(failed)}; the server log has "
                           "the details", status=500, code=grpc.StatusCode.INTERNAL, type="internal_error",
                           reason="error")


# Anthropic's error types by HTTP status (its 529 and our 503s are "overloaded_error"); other 4xx and 5xx fall
# back to invalid_request_error and api_error.
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(e: RequestError) -> dict[str, Any]:
    """Anthropic's error body, ``{"type": "error", "error": {"type", "message"}}``, of a refused or failed request
    (the engine's queue being full is "overloaded_error", as Anthropic names its own)."""
    kind = ANTHROPIC_ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    if e.reason == "overloaded":
        kind = "overloaded_error"
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def anthropic_in_band(e: Exception) -> dict[str, Any]:
    """The ``error`` event of a Messages stream that failed after its status line went out."""
    return anthropic_error(from_engine_error(e))


def anthropic_route(metrics: ServerMetrics) -> type[APIRoute]:
    """A route class whose routes answer their failures (their dependencies' too: a missing API key) in
    Anthropic's error shape, counted on ``metrics`` as rejected like every other route's; an unexpected failure
    is an ``api_error`` 500 with an error id."""

    class AnthropicRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def route(request: Request) -> Response:
                try:
                    return await handler(request)
                except Exception as e:  # noqa: BLE001 - answered in Anthropic's shape
                    err = e if isinstance(e, RequestError) else internal_error(e, f"POST {request.url.path} request")
                    metrics.rejected.labels("http", err.reason).inc()
                    return JSONResponse(anthropic_error(err), status_code=err.status)

            return route

    return AnthropicRoute


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


def install(app: FastAPI, metrics: ServerMetrics) -> None:
    """The app's error responses: a ``RequestError`` (counted as rejected), Starlette's 404 / 405 in OpenAI's
    shape, and a 500 with an error id for anything else."""

    async def request_error(request: Request, e: RequestError) -> JSONResponse:
        metrics.rejected.labels("http", e.reason).inc()
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.to_openai(), status_code=e.status, headers=headers)

    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, e.detail)
        return JSONResponse(error_body(message, "invalid_request_error", e.status_code), status_code=e.status_code)

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(_InternalErrors, metrics=metrics)
