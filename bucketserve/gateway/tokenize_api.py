"""vLLM's `/tokenize`, `/detokenize` and `/version`."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from aiohttp import web

from bucketserve.gateway.errors import InvalidArgumentError
from bucketserve.gateway.http_body import read_text
from bucketserve.gateway.openai_api import OpenAIApi
from bucketserve.gateway.openai_protocol import DetokenizeRequest, TokenizeRequest
from bucketserve.gateway.openai_request import chat_messages
from bucketserve.gateway.openai_responses import (
    DetokenizeResponse,
    TokenizeResponse,
    VersionResponse,
)
from bucketserve.gateway.request_body import parse_body


class TokenizeApi:
    """Tokenization with the served model's tokenizer and chat template, off the event loop
    like admission's; a tenant's key is needed as for generation."""

    def __init__(self, api: OpenAIApi) -> None:
        self.api = api
        self.admission = api.admission
        self.tokenizer = api.admission.tokenizer

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
        ]

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request, TokenizeRequest)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidArgumentError("give exactly one of prompt or messages")
        if body.messages is not None:
            messages = chat_messages(body.messages)
            text = await self.admission.off_loop(self.admission.chat_prompt, messages)
            special = bool(body.add_special_tokens)  # the template wrote them
        else:
            text, special = body.prompt or "", body.add_special_tokens is not False
        ids = await self.admission.off_loop(self.tokenizer.encode, text, special)
        strs = [self.tokenizer.backend.id_to_token(i) for i in ids]
        return web.json_response(
            TokenizeResponse(
                count=len(ids),
                max_model_len=self.admission.max_model_len,
                tokens=ids,
                token_strs=strs if body.return_token_strs else None,
            ).model_dump()
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request, DetokenizeRequest)
        most = self.admission.max_model_len  # no sequence here is longer
        if isinstance(body.tokens, list) and len(body.tokens) > most:  # before each id
            raise InvalidArgumentError(
                f"tokens has {len(body.tokens)} ids; this server detokenizes at most {most} "
                "(the model's max_model_len)"
            )
        ids = self.admission.token_ids("tokens", body.tokens)
        text = await self.admission.off_loop(self.tokenizer.decode, ids, False)
        return web.json_response(DetokenizeResponse(prompt=text).model_dump())

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response(VersionResponse(version=package_version()).model_dump())

    async def _body(self, request: web.Request, model: type) -> Any:
        self.api.tenant(request)
        text = await read_text(request, self.api.config.max_message_bytes)
        body = parse_body(model, text)
        self.api.check_model(body.model)
        return body


def package_version() -> str:
    try:
        return version("bucketserve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
