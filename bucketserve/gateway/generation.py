"""One admitted request's token stream, with its bookkeeping done exactly once at the end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bucketserve.gateway.errors import BucketServeError, InternalError, from_backend
from bucketserve.messages import ServeRequest, StreamDelta
from bucketserve.runtime.core.logprobs import TokenLogprob

if TYPE_CHECKING:
    from bucketserve.bucket_manager.config import TenantConfig


@dataclass
class Choice:
    """One sample of the request as streamed so far; `finish_reason` once it ended."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # when asked for
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None


class Generation:
    """`async for delta in generation`, and `await generation.close()` in a `finally`: when
    the consumer stops before the final delta (client gone, deadline, shutdown) that aborts
    the request in the backend, which frees its KV blocks at once. `on_done(self)` runs
    once, however the stream ends; `final` is then the finished delta or None. `choices`
    holds each of the request's n samples; `token_ids`, `text` and `logprobs` are sample
    0's."""

    def __init__(
        self,
        request: ServeRequest,
        tenant: TenantConfig,
        stream: AsyncIterator[StreamDelta],
        abort: Callable[[str], Awaitable[bool]],
        on_done: Callable[[Generation], None],
    ) -> None:
        self.request = request
        self.tenant = tenant
        self.final: StreamDelta | None = None
        self.cancel_reason: str | None = None  # set when the server aborts it (shutdown)
        self.first_token_time: float | None = None
        self.token_gaps: list[float] = []  # seconds between consecutive output tokens
        self.choices = [Choice() for _ in range(request.sampling_params.n)]
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._stream = stream
        self._abort = abort
        self._on_done = on_done
        self._last_time = request.arrival_time
        self._done = False
        self._deltas = self._iterate()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def logprobs(self) -> list[TokenLogprob | None]:
        return self.choices[0].logprobs

    @property
    def num_output_tokens(self) -> int:
        if self.final is not None:
            return self.final.num_output_tokens
        return sum(len(c.token_ids) for c in self.choices)

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._deltas

    async def close(self) -> None:
        """End the stream wherever it is; idempotent."""
        await self._deltas.aclose()
        await self._finish()

    async def _iterate(self) -> AsyncGenerator[StreamDelta, None]:
        try:
            async for delta in _mapped(self._stream):
                self._observe(delta)
                if delta.finished:
                    self.final = delta
                yield delta
                if delta.finished:
                    return
            raise InternalError(f"request {self.request_id} ended without a final message")
        finally:
            await self._finish()

    async def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            if self.final is None:
                await asyncio.shield(self._abort(self.request_id))
            aclose = getattr(self._stream, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._on_done(self)

    def _observe(self, delta: StreamDelta) -> None:
        choice = self.choices[delta.index]
        choice.text += delta.text
        choice.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            choice.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason, choice.error = delta.finish_reason, delta.error
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        n = len(delta.token_ids)
        if not n:
            return
        now = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.token_gaps.extend([(now - self._last_time) / n] * n)
        self._last_time = now


async def _mapped(stream: AsyncIterator[StreamDelta]) -> AsyncIterator[StreamDelta]:
    """The backend's stream with its admission errors (raised by a lazy first step) mapped
    to the gateway's, so the front ends see one kind of error."""
    try:
        async for delta in stream:
            yield delta
    except BucketServeError:
        raise
    except Exception as exc:
        raise from_backend(exc) from exc
