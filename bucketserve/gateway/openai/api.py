"""The OpenAI-compatible routes: `/v1/models`, `/v1/completions` and
`/v1/chat/completions` (SSE when streamed), and vLLM's `/tokenize`, `/detokenize`,
`/version` and `/reset_prefix_cache`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from typing import TypeVar

from aiohttp import web

from bucketserve.gateway.access_log import GENERATION, TENANT
from bucketserve.gateway.admission import Admission
from bucketserve.gateway.errors import (
    BucketServeError,
    DeadlineExceededError,
    GenerationError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.generation import Generation
from bucketserve.gateway.openai.body import M, parse_body, read_text
from bucketserve.gateway.openai.protocol import (
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ResetPrefixCacheResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from bucketserve.gateway.openai.serving import (
    OpenAIFormat,
    chat_messages,
    error_event,
    parse_request,
)
from bucketserve.gateway.tenant_registry import parse_bearer
from bucketserve.gateway.tools.request_tools import RequestTools
from bucketserve.gateway.tools.tool_parsers import tool_parser
from bucketserve.messages import StreamDelta

T = TypeVar("T")
OFF_LOOP_CHARS = 256 * 1024  # bodies from this size are parsed off the event loop


class OpenAIApi:
    """The handlers over one Admission. Tokenization uses the served model's tokenizer and
    chat template, off the event loop like admission's; every route but /version needs a
    tenant's key, as generation does."""

    def __init__(self, admission: Admission, model_name: str, config: GatewayConfig) -> None:
        self.admission = admission
        self.tokenizer = admission.tokenizer
        self.model_name = model_name
        self.config = config
        self.created = int(time.time())
        self.tool_parser = tool_parser(admission.model.tool_call_parser)

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
            web.get("/version", self.version),
            web.post("/reset_prefix_cache", self.reset_prefix_cache),
        ]

    async def models(self, request: web.Request) -> web.Response:
        self._tenant(request)
        card = ModelCard(
            id=self.model_name, created=self.created, max_model_len=self.admission.max_model_len
        )
        return web.json_response(ModelList(data=[card]).model_dump())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

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
        ids, strs = await self.admission.off_loop(
            self._tokens, text, special, body.return_token_strs
        )
        return web.json_response(
            TokenizeResponse(
                count=len(ids),
                max_model_len=self.admission.max_model_len,
                tokens=ids,
                token_strs=strs,
            ).model_dump()
        )

    def _tokens(self, text: str, special: bool, strs: bool) -> tuple[list[int], list[str] | None]:
        """The ids of `text`, and each id's token string if `strs` (in the pool)."""
        ids = self.tokenizer.encode(text, special)
        if not strs:
            return ids, None
        return ids, [self.tokenizer.backend.id_to_token(i) for i in ids]

    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request, DetokenizeRequest)  # counted the ids before each
        ids = self.admission.token_ids("tokens", body.tokens)
        text = await self.admission.off_loop(self.tokenizer.decode, ids, False)
        return web.json_response(DetokenizeResponse(prompt=text).model_dump())

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response(VersionResponse(version=package_version()).model_dump())

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """Every worker forgets its cached prefix blocks (requests running keep theirs):
        the next request with a known prefix computes it again."""
        self._tenant(request)
        forgotten = await self.admission.backend.reset_prefix_cache()
        body = ResetPrefixCacheResponse(forgotten_blocks=forgotten)
        return web.json_response(body.model_dump())

    def _tenant(self, request: web.Request) -> str | None:
        """The request's API key, once it authenticates a tenant."""
        api_key = parse_bearer(request.headers.get("Authorization"))
        request[TENANT] = self.admission.tenant(api_key).name
        return api_key

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise NotFoundError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}"
            )

    async def _body(self, request: web.Request, model: type[M]) -> M:
        self._tenant(request)
        text = await read_text(request, self.config.max_message_bytes)
        body = await self._parse(text, partial(parse_body, model, limits=self.admission.limits))
        self._check_model(getattr(body, "model", None))
        return body

    async def _parse(self, text: str, parse: Callable[[str], T]) -> T:
        """`parse(text)`, in the tokenizer pool when the body is large: parsing megabytes of
        JSON would hold up every stream on the event loop."""
        if len(text) < OFF_LOOP_CHARS:
            return parse(text)
        return await self.admission.off_loop(parse, text)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        deadline = _Deadline(self.config.http_request_timeout_s)
        api_key = self._tenant(request)
        with self.admission.counted():
            text = await read_text(request, self.config.max_message_bytes)
            body, inp = await self._parse(
                text, partial(parse_request, chat=chat, limits=self.admission.limits)
            )
            self._check_model(body.model)
            tools = RequestTools.of(inp)
            if tools is not None:
                tools.check_parser(self.tool_parser)
        gen = await deadline.run(self.admission.admit(inp, api_key), None)
        request[GENERATION] = gen
        prompt_tokens = len(gen.request.prompt_token_ids)
        try:
            echo = isinstance(body, CompletionRequest) and body.echo
            prefix = await self.admission.off_loop(self._prompt_text, gen) if echo else ""
            fmt = OpenAIFormat(
                body,
                tools,
                gen.request_id,
                self.model_name,
                prompt_tokens,
                self._token_text,
                prefix,
                self.tool_parser,
            )
            if body.stream:
                return await _stream(request, gen, fmt, deadline)
            await deadline.run(_drain(gen), gen)
        finally:
            await gen.close()
        response = fmt.response(
            _final(gen), gen.choices, gen.request.prompt_token_ids, gen.prompt_logprobs
        )
        return web.json_response(response)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _prompt_text(self, gen: Generation) -> str:
        text = gen.request.prompt_text
        if text is None:
            text = self.tokenizer.decode(gen.request.prompt_token_ids)
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
    """Every choice's events as its deltas come (each chunk names its choice's index),
    then `[DONE]`."""
    stream = aiter(gen)
    # admission errors surface with the first delta, before any header is sent
    first = await deadline.run(anext(stream), gen)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)

    async def send(events: list[str]) -> None:
        for data in events:
            await response.write(f"data: {data}\n\n".encode())

    await send(fmt.opening(len(gen.choices), gen.request.prompt_token_ids, first.prompt_logprobs))
    try:
        delta: StreamDelta | None = first
        while delta is not None:
            await send(fmt.events(delta, len(gen.choices[delta.index].token_ids)))
            if delta.finished:
                break
            delta = await deadline.run(anext(stream, None), gen)
    except BucketServeError as exc:  # headers are out: the error goes in the stream
        await send([error_event(exc)])
    await send(["[DONE]"])
    await response.write_eof()
    return response


def package_version() -> str:
    try:
        return version("bucketserve")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
