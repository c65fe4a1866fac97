"""What the gateway needs from the serving layer: `bucketserve.controller.controller.Controller`
fits it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from bucketserve.messages import ModelInfo, ServeRequest, ServiceStats, StreamDelta


class Backend(Protocol):
    """`submit` raises ValueError (bad input), QueueFullError or NoWorkersError before
    anything is queued; the iterator ends with exactly one `finished` delta, and closing it
    early aborts the request."""

    @property
    def model_info(self) -> ModelInfo: ...

    async def start(self) -> None: ...

    def submit(self, request: ServeRequest) -> AsyncIterator[StreamDelta]: ...

    async def abort(self, request_id: str) -> bool: ...

    def stats(self) -> ServiceStats: ...

    async def reset_prefix_cache(self) -> int:
        """Every worker forgets its cached prefix blocks; how many were forgotten."""
        ...

    def serving(self) -> bool:
        """A live worker for every phase: health checks answer from it."""
        ...

    async def shutdown(self) -> None: ...
