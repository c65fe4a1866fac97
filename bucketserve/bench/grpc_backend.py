"""Sends bench requests over the gRPC API with the asyncio SDK, streaming."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict

from bucketserve.bench.request import BenchRequest
from bucketserve.bench.request_record import RequestRecord
from bucketserve.gateway.async_client import AsyncClient
from bucketserve.gateway.errors import ResourceExhaustedError
from bucketserve.runtime.core.sampling_params import SamplingParams


class GrpcBackend:
    """One channel per tenant key; greedy, `ignore_eos`, so every request makes exactly
    `max_tokens` tokens unless the server stops it."""

    name = "grpc"

    def __init__(self, target: str, keys: dict[str, str | None], timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.clients = {
            tenant: AsyncClient(target, api_key=key or "", timeout=timeout_s)
            for tenant, key in keys.items()
        }

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = _record(request)
        params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
        client = self.clients[request.tenant]
        record.send_time = time.perf_counter()
        try:
            stream = client.stream(request.prompt, params)
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.token_ids and record.first_token_time is None:
                        record.first_token_time = now
                    record.output_tokens += len(chunk.token_ids)
                    if chunk.finished:
                        record.end_time = now
                        _final(record, chunk)
        except Exception as exc:  # a failed request is a result, not a crash
            record.error = f"{type(exc).__name__}: {exc}"
            record.refused = isinstance(exc, ResourceExhaustedError)
        if record.end_time is None and record.error is None:
            record.error = "the stream ended without a final message"
        return record

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


def _record(request: BenchRequest) -> RequestRecord:
    return RequestRecord(
        request.index, request.tenant, request.kind, request.prompt_len, request.max_tokens
    )


def _final(record: RequestRecord, chunk) -> None:
    record.finish_reason = chunk.finish_reason
    record.server_prompt_tokens = chunk.prompt_tokens
    record.server_completion_tokens = chunk.completion_tokens
    if chunk.finish_reason == "error":
        record.error = chunk.error or "error"
    if chunk.timings is not None:
        record.server_timings = asdict(chunk.timings)
    record.request_bucket = list(chunk.request_bucket) if chunk.request_bucket else None
    record.shape_bucket = list(chunk.shape_bucket) if chunk.shape_bucket else None
