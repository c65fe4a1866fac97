"""OpenAI-compatible `/v1/models`, `/v1/completions` and `/v1/chat/completions` handlers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from aiohttp import web

from gateway.access_log import GENERATION, TENANT
from gateway.admission import Admission
from gateway.errors import (
    DeadlineExceededError,
    GenerationError,
    NotFoundError,
    UnavailableError,
)
from gateway.gateway_config import GatewayConfig
from gateway.generation import Generation
from gateway.http_body import read_text
from gateway.openai_format import OpenAIFormat, error_body
from gateway.openai_request import OpenAIRequest
from gateway.openai_responses import ModelCard, ModelList
from gateway.tenant_registry import parse_bearer
from kv_worker.messages import StreamDelta

T = TypeVar("T")


class OpenAIApi:
    def __init__(self, admission: Admission, model_name: str, config: GatewayConfig) -> None:
        self.admission = admission
        self.model_name = model_name
        self.config = config
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ]

    async def models(self, request: web.Request) -> web.Response:
        self.tenant(request)
        card = ModelCard(
            id=self.model_name, created=self.created, max_model_len=self.admission.max_model_len
        )
        return web.json_response(ModelList(data=[card]).model_dump())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    def tenant(self, request: web.Request) -> str | None:
        """The request's API key, once it authenticates a tenant."""
        api_key = parse_bearer(request.headers.get("Authorization"))
        request[TENANT] = self.admission.tenant(api_key).name
        return api_key

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise NotFoundError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}"
            )

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        deadline = _Deadline(self.config.http_request_timeout_s)
        api_key = self.tenant(request)
        text = await read_text(request, self.config.max_message_bytes)
        oai = OpenAIRequest.parse(text, chat)
        self.check_model(oai.model)
        gen = await deadline.run(self.admission.admit(oai.input, api_key), None)
        request[GENERATION] = gen
        prompt_tokens = len(gen.request.prompt_token_ids)
        fmt = OpenAIFormat(oai, gen.request_id, self.model_name, prompt_tokens)
        try:
            if oai.stream:
                return await _stream(request, gen, fmt, deadline)
            await deadline.run(_drain(gen), gen)
        finally:
            await gen.close()
        return web.json_response(fmt.whole(*_final(gen)))


class _Deadline:
    """gateway.http_request_timeout_s from the request's arrival (None: no bound)."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else time.monotonic() + timeout_s

    async def run(self, step: Awaitable[T], gen: Generation | None) -> T:
        if self.at is None:
            return await step
        try:
            return await asyncio.wait_for(step, max(0.0, self.at - time.monotonic()))
        except asyncio.TimeoutError:
            raise self.error(gen) from None

    def error(self, gen: Generation | None) -> DeadlineExceededError:
        done = f" after {gen.num_output_tokens} tokens" if gen is not None else ""
        return DeadlineExceededError(
            f"the request ran past this server's limit of {self.timeout_s:g}s "
            f"(gateway.http_request_timeout_s) and was aborted{done}; lower max_tokens"
        )


async def _drain(gen: Generation) -> None:
    async for _ in gen:
        pass


def _final(gen: Generation) -> tuple[StreamDelta, str]:
    """The finished delta and the whole text, or the error the request ended with."""
    final = gen.final
    if final is None or final.finish_reason == "error":
        raise GenerationError(f"generation failed: {final.error if final else 'no final'}")
    if final.finish_reason == "cancelled" and gen.cancel_reason:
        raise UnavailableError(gen.cancel_reason)
    return final, gen.text


async def _stream(
    request: web.Request, gen: Generation, fmt: OpenAIFormat, deadline: _Deadline
) -> web.StreamResponse:
    deltas: AsyncIterator[StreamDelta] = aiter(gen)
    # admission errors surface with the first delta, before any header is sent
    first = await deadline.run(anext(deltas), gen)
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
    try:
        while delta is not None:
            await _send_delta(send, fmt, delta, len(gen.token_ids))
            delta = await deadline.run(anext(deltas, None), gen)
    except DeadlineExceededError as exc:  # headers are out: the error goes in the stream
        await send({"error": error_body(exc)["error"]})
    await send("[DONE]")
    await response.write_eof()
    return response


async def _send_delta(send: Any, fmt: OpenAIFormat, delta: StreamDelta, tokens: int) -> None:
    if delta.text:
        await send(fmt.chunk(text=delta.text, completion_tokens=tokens))
    if not delta.finished:
        return
    if delta.finish_reason == "error":
        error = GenerationError(f"generation failed: {delta.error}")
        await send({"error": error_body(error)["error"]})
    else:
        reason = fmt.finish_reason(delta)
        await send(fmt.chunk(finish_reason=reason, completion_tokens=tokens))
    if fmt.oai.include_usage:
        await send(fmt.usage_chunk(delta))
