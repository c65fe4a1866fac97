"""Drives a backend with a workload: open-loop Poisson arrivals or a closed loop of clients."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Protocol

from tqdm import tqdm

from bucketserve.bench.arrivals import PoissonArrivals
from bucketserve.bench.request import BenchRequest
from bucketserve.bench.request_record import RequestRecord


class Backend(Protocol):
    name: str

    async def send(self, request: BenchRequest) -> RequestRecord: ...


class LoadRunner:
    """Stops sending at `duration_s` (None: no bound) or when the requests run out, then waits
    for every sent request to end; each sent request yields exactly one record."""

    def __init__(self, backend: Backend, duration_s: float | None = None, progress: bool = True):
        if duration_s is not None and not duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {duration_s}")
        self.backend = backend
        self.duration_s = duration_s
        self.progress = progress

    async def open_loop(
        self, requests: Sequence[BenchRequest], rate: float, seed: int = 0
    ) -> list[RequestRecord]:
        offsets = PoissonArrivals(seed).times(rate, len(requests))
        if self.duration_s is not None:
            offsets = [t for t in offsets if t <= self.duration_s]
        bar = self._bar(len(offsets), f"{rate:g} req/s")
        start = time.perf_counter()
        tasks = []
        for request, offset in zip(requests, offsets, strict=False):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._send(request, bar)))
        records = list(await asyncio.gather(*tasks))
        bar.close()
        return records

    async def closed_loop(
        self, requests: Sequence[BenchRequest], concurrency: int
    ) -> list[RequestRecord]:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 client, got {concurrency}")
        pending = iter(requests)
        bar = self._bar(len(requests), f"{concurrency} clients")
        deadline = None if self.duration_s is None else time.perf_counter() + self.duration_s
        records: list[RequestRecord] = []

        async def client() -> None:
            for request in pending:
                if deadline is not None and time.perf_counter() > deadline:
                    return
                records.append(await self._send(request, bar))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        bar.close()
        return sorted(records, key=lambda r: r.index)

    async def _send(self, request: BenchRequest, bar: tqdm) -> RequestRecord:
        record = await self.backend.send(request)
        bar.update(1)
        return record

    def _bar(self, total: int, label: str) -> tqdm:
        return tqdm(total=total, desc=label, unit="req", disable=not self.progress, leave=False)
