"""OpenAI-compatible `/v1/models`, `/v1/completions` and `/v1/chat/completions` handlers."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from aiohttp import web

from bucketserve.gateway.access_log import GENERATION, TENANT
from bucketserve.gateway.admission import Admission
from bucketserve.gateway.errors import (
    BucketServeError,
    DeadlineExceededError,
    GenerationError,
    NotFoundError,
    UnavailableError,
)
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.generation import Generation
from bucketserve.gateway.http_body import read_text
from bucketserve.gateway.openai_format import Finished, OpenAIFormat, error_body
from bucketserve.gateway.openai_request import OpenAIRequest
from bucketserve.gateway.openai_responses import ModelCard, ModelList
from bucketserve.gateway.tenant_registry import parse_bearer
from bucketserve.messages import StreamDelta

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
        prefix = self._prompt_text(gen) if oai.echo else ""
        fmt = OpenAIFormat(
            oai, gen.request_id, self.model_name, prompt_tokens, self._token_text, prefix
        )
        try:
            if oai.stream:
                return await _stream(request, gen, fmt, deadline)
            await deadline.run(_drain(gen), gen)
        finally:
            await gen.close()
        final = _final(gen)
        fmt.prompt(gen.request.prompt_token_ids, gen.prompt_logprobs)
        finished = [
            Finished(final, c.text, c.token_ids, c.logprobs, c.finish_reason)
            for c in gen.choices
        ]
        return web.json_response(fmt.whole_choices(finished))

    def _token_text(self, token_id: int) -> str:
        return self.admission.tokenizer.decode([token_id], skip_special_tokens=False)

    def _prompt_text(self, gen: Generation) -> str:
        text = gen.request.prompt_text
        if text is None:
            text = self.admission.tokenizer.decode(gen.request.prompt_token_ids)
        return text


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
        except TimeoutError:
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


def _final(gen: Generation) -> StreamDelta:
    """The finished delta, or the error the request ended with."""
    final = gen.final
    if final is None:
        raise GenerationError("generation failed: no final")
    failed = [c for c in gen.choices if c.finish_reason == "error"]
    if failed:
        raise GenerationError(f"generation failed: {failed[0].error}")
    if final.finish_reason == "cancelled" and gen.cancel_reason:
        raise UnavailableError(gen.cancel_reason)
    return final


async def _stream(
    request: web.Request, gen: Generation, fmt: OpenAIFormat, deadline: _Deadline
) -> web.StreamResponse:
    """Every choice's deltas as they come (each chunk names its choice's index); usage,
    when asked for, once after the request's final delta."""
    stream = aiter(gen)
    # admission errors surface with the first delta, before any header is sent
    first = await deadline.run(anext(stream), gen)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)

    async def send(payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    prompt_ids, prompt_logprobs = gen.request.prompt_token_ids, first.prompt_logprobs
    for index in range(len(gen.choices)):
        if fmt.oai.chat:
            await send(fmt.chunk(role="assistant", text="", index=index))
        elif fmt.prefix:
            await send(
                fmt.chunk(
                    text=fmt.prefix, index=index, token_ids=prompt_ids, logprobs=prompt_logprobs
                )
            )
    try:
        delta: StreamDelta | None = first
        while delta is not None:
            tokens = len(gen.choices[delta.index].token_ids)
            await _send_delta(send, fmt, delta, tokens)
            if delta.finished:
                if fmt.oai.include_usage:
                    await send(fmt.usage_chunk(delta))
                break
            delta = await deadline.run(anext(stream, None), gen)
    except BucketServeError as exc:  # headers are out: the error goes in the stream
        await send({"error": error_body(exc)["error"]})
    await send("[DONE]")
    await response.write_eof()
    return response


async def _send_delta(send: Any, fmt: OpenAIFormat, delta: StreamDelta, tokens: int) -> None:
    index = delta.index
    if delta.text or (delta.logprobs and delta.token_ids):
        await send(
            fmt.chunk(
                text=delta.text,
                completion_tokens=tokens,
                index=index,
                token_ids=delta.token_ids,
                logprobs=delta.logprobs,
            )
        )
    if delta.finish_reason is None:
        return
    if delta.finish_reason == "error":
        error = GenerationError(f"generation failed: {delta.error}")
        await send({"error": error_body(error)["error"]})
    else:
        reason = fmt.finish_reason(delta)
        await send(fmt.chunk(finish_reason=reason, completion_tokens=tokens, index=index))
