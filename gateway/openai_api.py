"""OpenAI-compatible `/v1/models`, `/v1/completions` and `/v1/chat/completions` handlers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from aiohttp import web

from gateway.access_log import GENERATION, TENANT
from gateway.admission import Admission
from gateway.errors import (
    BucketServeError,
    DeadlineExceededError,
    GenerationError,
    NotFoundError,
    UnavailableError,
)
from gateway.gateway_config import GatewayConfig
from gateway.generate_input import GenerateInput
from gateway.generation import Generation
from gateway.http_body import read_text
from gateway.openai_format import Finished, OpenAIFormat, error_body
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
        gens = await self._admit(oai, api_key, deadline)
        gen = gens[0]
        request[GENERATION] = gen
        prompt_tokens = len(gen.request.prompt_token_ids)
        prefix = self._prompt_text(gen) if oai.echo else ""
        fmt = OpenAIFormat(
            oai, gen.request_id, self.model_name, prompt_tokens, self._token_text, prefix
        )
        try:
            if oai.stream:
                return await _stream(request, gens, fmt, deadline)
            await deadline.run(asyncio.gather(*(_drain(g) for g in gens)), gen)
        finally:
            for g in gens:
                await g.close()
        finished = []
        for g in gens:
            final, whole = _final(g)
            finished.append(Finished(final, whole, g.token_ids, g.logprobs))
        return web.json_response(fmt.whole_choices(finished))

    async def _admit(
        self, oai: OpenAIRequest, api_key: str | None, deadline: _Deadline
    ) -> list[Generation]:
        """One generation per choice (`n`): choice i's seed is seed + i, its id the
        request id with `-i` (for n > 1). All or none are admitted."""
        gens: list[Generation] = []
        try:
            for i in range(oai.n):
                inp = oai.input if oai.n == 1 else _choice_input(oai.input, i)
                gens.append(await deadline.run(self.admission.admit(inp, api_key), None))
        except BaseException:
            for g in gens:
                await g.close()
            raise
        return gens

    def _token_text(self, token_id: int) -> str:
        return self.admission.tokenizer.decode([token_id], skip_special_tokens=False)

    def _prompt_text(self, gen: Generation) -> str:
        text = gen.request.prompt_text
        if text is None:
            text = self.admission.tokenizer.decode(gen.request.prompt_token_ids)
        return text


def _choice_input(inp: GenerateInput, index: int) -> GenerateInput:
    sampling = dict(inp.sampling)
    if sampling.get("seed") is not None:
        sampling["seed"] += index
    request_id = None if inp.request_id is None else f"{inp.request_id}-{index}"
    return dataclasses.replace(inp, sampling=sampling, request_id=request_id)


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
    request: web.Request, gens: list[Generation], fmt: OpenAIFormat, deadline: _Deadline
) -> web.StreamResponse:
    """Every choice's deltas as they come (each chunk names its choice's index); usage,
    when asked for, once after the last choice's final chunk."""
    streams: list[AsyncIterator[StreamDelta]] = [aiter(g) for g in gens]
    # admission errors surface with the first delta, before any header is sent
    firsts = [await deadline.run(anext(s), g) for s, g in zip(streams, gens, strict=True)]
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)

    async def send(payload: Any) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    for index in range(len(gens)):
        if fmt.oai.chat:
            await send(fmt.chunk(role="assistant", text="", index=index))
        elif fmt.prefix:
            await send(fmt.chunk(text=fmt.prefix, index=index))
    queue: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()
    for index, first in enumerate(firsts):
        queue.put_nowait((index, first))

    async def pump(index: int) -> None:
        try:
            async for delta in streams[index]:
                await queue.put((index, delta))
        except Exception as exc:  # reported in the stream
            await queue.put((index, exc))
        await queue.put((index, None))

    pumps = [asyncio.ensure_future(pump(i)) for i, f in enumerate(firsts) if not f.finished]
    open_streams, finals = len(pumps), []
    try:
        while True:
            if queue.empty() and not open_streams:
                break
            index, item = await deadline.run(queue.get(), gens[0])
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            gen = gens[index]
            await _send_delta(send, fmt, item, len(gen.token_ids), index)
            if item.finished:
                finals.append(item)
        if fmt.oai.include_usage and finals:
            await send(fmt.usage_chunk(_total(finals)))
    except BucketServeError as exc:  # headers are out: the error goes in the stream
        await send({"error": error_body(exc)["error"]})
    finally:
        for task in pumps:
            task.cancel()
    await send("[DONE]")
    await response.write_eof()
    return response


def _total(finals: list[StreamDelta]) -> StreamDelta:
    """The usage of every choice: the prompt once, all of their outputs."""
    total = dataclasses.replace(finals[0])
    total.num_output_tokens = sum(f.num_output_tokens for f in finals)
    return total


async def _send_delta(
    send: Any, fmt: OpenAIFormat, delta: StreamDelta, tokens: int, index: int = 0
) -> None:
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
    if not delta.finished:
        return
    if delta.finish_reason == "error":
        error = GenerationError(f"generation failed: {delta.error}")
        await send({"error": error_body(error)["error"]})
    else:
        reason = fmt.finish_reason(delta)
        await send(fmt.chunk(finish_reason=reason, completion_tokens=tokens, index=index))
