"""What the gateway needs from the serving layer: `deploy.controller.Controller` fits it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from runtime.request import ServeRequest, StreamDelta


class Backend(Protocol):
    """`submit` raises ValueError (bad input), QueueFullError or NoWorkersError before
    anything is queued; the iterator ends with exactly one `finished` delta, and closing it
    early aborts the request. `model_info` is a deploy.model_info.ModelInfo (name, limits,
    tokenizer); `stats()` a deploy.service_stats.ServiceStats."""

    @property
    def model_info(self) -> Any: ...

    async def start(self) -> None: ...

    def submit(self, request: ServeRequest) -> AsyncIterator[StreamDelta]: ...

    async def abort(self, request_id: str) -> bool: ...

    def stats(self) -> Any: ...

    async def shutdown(self) -> None: ...
