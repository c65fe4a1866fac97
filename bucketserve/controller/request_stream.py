"""The async iterator `Controller.submit` returns: one request's StreamDeltas, final last."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from bucketserve.messages import StreamDelta


class RequestStream:
    """Yields the request's deltas; the one with `finished=True` is the last.

    Closing it before that (`aclose()`, or leaving `async with`) means the
    client went away: the request is aborted and its KV blocks freed.
    """

    def __init__(self, request_id: str, abort: Callable[[str], Awaitable[bool]]) -> None:
        self.request_id = request_id
        self._abort = abort
        self._queue: asyncio.Queue[StreamDelta] = asyncio.Queue()
        self._finished = False  # the final delta was handed out
        self._final_queued = False
        self._closed = False

    def put(self, delta: StreamDelta) -> None:
        if self._final_queued:
            raise RuntimeError(f"request {self.request_id} already has its final delta")
        self._final_queued = delta.finished
        self._queue.put_nowait(delta)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamDelta:
        if self._finished or self._closed:
            raise StopAsyncIteration
        delta = await self._queue.get()
        self._finished = delta.finished
        return delta

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._final_queued:
            await self._abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def collect(self) -> list[StreamDelta]:
        """Every delta up to and including the final one."""
        return [delta async for delta in self]
