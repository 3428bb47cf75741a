"""The OpenAI-compatible HTTP app: the endpoint modules' routers on one FastAPI app, with the error responses
(``errors``) and the OpenAPI schema of the request bodies the handlers parse themselves."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI

from jaxserve.config.network import ClusterSecurity
from jaxserve.server.access import AdminConfig
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.limits import RequestLimits
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openai import errors
from jaxserve.server.openai.admin import Admin
from jaxserve.server.openai.chat import ChatCompletions
from jaxserve.server.openai.completions import Completions
from jaxserve.server.openai.context import APIContext
from jaxserve.server.openai.health import Health
from jaxserve.server.openai.messages import Messages
from jaxserve.server.openai.models import Models
from jaxserve.server.openai.responses import Responses
from jaxserve.server.openai.tokens import Tokens


class OpenAIServer:
    """Builds the FastAPI app over an ``AsyncEngine``."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, served_model_names: list[str], *,
                 api_key: str | Sequence[str] | None = None, max_body_bytes: int = 4 * 2**20,
                 limits: RequestLimits | None = None, enable_auto_tool_choice: bool = False,
                 tool_call_parser: str | None = None, prompt_tokens_details: bool = False,
                 cache_salt_per_api_key: bool = False, admin: AdminConfig | None = None,
                 cluster: ClusterSecurity | None = None, reasoning_parser: str | None = None,
                 response_role: str = "assistant", structured_in_reasoning: bool = False):
        self.ctx = APIContext(engine, metrics, served_model_names, api_key=api_key, max_body_bytes=max_body_bytes,
                              limits=limits, prompt_tokens_details=prompt_tokens_details,
                              cache_salt_per_api_key=cache_salt_per_api_key, admin=admin, cluster=cluster)
        # In this order on the app: the published schema lists its paths so.
        chat = ChatCompletions(self.ctx, enable_auto_tool_choice=enable_auto_tool_choice,
                               tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                               response_role=response_role, structured_in_reasoning=structured_in_reasoning)
        self.endpoints = [Health(self.ctx), Models(self.ctx), Admin(self.ctx), Completions(self.ctx), chat,
                          Messages(self.ctx, chat), Responses(self.ctx, chat), Tokens(self.ctx)]

    def app(self) -> FastAPI:
        app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
        errors.install(app, self.ctx.metrics)
        for endpoint in self.endpoints:
            app.include_router(endpoint.router())
        app.openapi = lambda: self._openapi(app)
        return app

    def _openapi(self, app: FastAPI) -> dict:
        """FastAPI's schema plus the request bodies the handlers parse themselves."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title="jaxserve", version="1", routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (body for endpoint in self.endpoints for body in endpoint.bodies):
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema
