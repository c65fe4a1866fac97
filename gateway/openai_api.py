"""OpenAI-compatible `/v1/models`, `/v1/completions` and `/v1/chat/completions` handlers."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from gateway.admission import Admission
from gateway.errors import GenerationError, InvalidArgumentError, NotFoundError, UnavailableError
from gateway.generation import Generation
from gateway.openai_format import OpenAIFormat, error_body
from gateway.openai_request import OpenAIRequest
from gateway.tenant_registry import parse_bearer
from kv_worker.messages import StreamDelta


class OpenAIApi:
    def __init__(self, admission: Admission, model_name: str) -> None:
        self.admission = admission
        self.model_name = model_name
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ]

    async def models(self, request: web.Request) -> web.Response:
        self._tenant(request)
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "bucketserve",
            "max_model_len": self.admission.max_model_len,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    def _tenant(self, request: web.Request) -> str | None:
        api_key = parse_bearer(request.headers.get("Authorization"))
        self.admission.tenant(api_key)
        return api_key

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        api_key = self._tenant(request)
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"the request body is not valid JSON: {exc}") from exc
        oai = OpenAIRequest.parse(body, chat)
        if oai.model is not None and oai.model != self.model_name:
            raise NotFoundError(
                f"the model {oai.model!r} does not exist; this server serves {self.model_name!r}"
            )
        gen = self.admission.admit(oai.input, api_key)
        fmt = OpenAIFormat(oai, gen.request_id, self.model_name)
        try:
            if oai.stream:
                return await _stream(request, gen, fmt)
            async for _ in gen:
                pass
        finally:
            await gen.close()
        return web.json_response(fmt.whole(*_final(gen)))


def _final(gen: Generation) -> tuple[StreamDelta, str]:
    """The finished delta and the whole text, or the error the request ended with."""
    final = gen.final
    if final is None or final.finish_reason == "error":
        raise GenerationError(f"generation failed: {final.error if final else 'no final'}")
    if final.finish_reason == "cancelled" and gen.cancel_reason:
        raise UnavailableError(gen.cancel_reason)
    return final, gen.text


async def _stream(request: web.Request, gen: Generation, fmt: OpenAIFormat) -> web.StreamResponse:
    deltas = aiter(gen)
    first = await anext(deltas)  # admission errors surface here, before any header is sent
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)

    async def send(payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    if fmt.oai.chat:
        await send(fmt.chunk(role="assistant", text=""))
    delta: StreamDelta | None = first
    while delta is not None:
        if delta.text:
            await send(fmt.chunk(text=delta.text))
        if delta.finished:
            if delta.finish_reason == "error":
                error = GenerationError(f"generation failed: {delta.error}")
                await send({"error": error_body(error)["error"]})
            else:
                await send(fmt.chunk(finish_reason=fmt.finish_reason(delta)))
            if fmt.oai.include_usage:
                await send(fmt.usage_chunk(delta))
        delta = await anext(deltas, None)
    await send("[DONE]")
    await response.write_eof()
    return response
