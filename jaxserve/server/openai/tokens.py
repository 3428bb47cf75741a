"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, field for field."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from jaxserve.server.openai.context import APIContext, json_body
from jaxserve.server.openai.errors import engine_errors
from jaxserve.server.openai.protocol import DetokenizeRequest, TokenizeRequest, parse


class Tokens:
    """The tokenizer's view of a prompt, as generation would see it."""

    bodies = (TokenizeRequest, DetokenizeRequest)

    def __init__(self, ctx: APIContext):
        self.ctx = ctx

    def router(self) -> APIRouter:
        router = self.ctx.router()
        router.add_api_route("/tokenize", self.tokenize, methods=["POST"], openapi_extra=json_body(TokenizeRequest))
        router.add_api_route("/detokenize", self.detokenize, methods=["POST"],
                             openapi_extra=json_body(DetokenizeRequest))
        return router

    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``/tokenize``: the token ids of a prompt (``prompt``) or of a conversation in the chat
        template (``messages``), as generation would see them."""
        ctx = self.ctx
        req: TokenizeRequest = parse(TokenizeRequest, await ctx.read_json(request))
        ctx.lora_for(req.model)
        messages = req.template_messages()
        with engine_errors():
            ids = await ctx.engine.tokenize_prompt(req.prompt, messages, req.add_generation_prompt,
                                                   template_options=req.template_options(),
                                                   add_special_tokens=req.special_tokens())
            strs = await ctx.engine.token_pieces(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": ctx.engine.info.get("max_model_len"),
                             "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's ``/detokenize``: the text of token ids."""
        req: DetokenizeRequest = parse(DetokenizeRequest, await self.ctx.read_json(request))
        self.ctx.lora_for(req.model)
        with engine_errors():
            text = await self.ctx.engine.detokenize(req.tokens)
        return JSONResponse({"prompt": text})
