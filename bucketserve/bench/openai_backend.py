"""Sends bench requests to any OpenAI-compatible server: /v1/completions, SSE streaming."""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from bucketserve.bench.grpc_backend import _record
from bucketserve.bench.request import BenchRequest
from bucketserve.bench.request_record import RequestRecord


class OpenAIBackend:
    """Streams with `stream_options.include_usage`; TTFT is the first non-empty text delta,
    the token count the usage chunk's (vLLM's benchmark does the same)."""

    name = "openai"

    def __init__(
        self, base_url: str, model: str, keys: dict[str, str | None], timeout_s: float
    ) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.keys = keys
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(limit=0),
        )

    async def send(self, request: BenchRequest) -> RequestRecord:
        record = _record(request)
        body = {
            "model": self.model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        key = self.keys.get(request.tenant)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        record.send_time = time.perf_counter()
        try:
            async with self.session.post(self.url, json=body, headers=headers) as response:
                if response.status != 200:
                    text = (await response.text())[:300]
                    record.error = f"HTTP {response.status}: {text}"
                    record.refused = response.status == 429
                    return record
                await self._read(response, record)
        except Exception as exc:  # a failed request is a result, not a crash
            record.error = f"{type(exc).__name__}: {exc}"
        return record

    async def _read(self, response: aiohttp.ClientResponse, record: RequestRecord) -> None:
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            now = time.perf_counter()
            if data == "[DONE]":
                record.end_time = now
                break
            _apply(json.loads(data), record, now)
        if record.end_time is None and record.error is None:
            record.error = "the SSE stream ended without [DONE]"

    async def close(self) -> None:
        await self.session.close()


def _apply(event: dict[str, Any], record: RequestRecord, now: float) -> None:
    if "error" in event:
        record.error = str(event["error"].get("message", event["error"]))
    for choice in event.get("choices") or []:
        if choice.get("text") and record.first_token_time is None:
            record.first_token_time = now
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if usage:
        record.server_prompt_tokens = usage.get("prompt_tokens")
        record.server_completion_tokens = usage.get("completion_tokens")
        record.output_tokens = usage.get("completion_tokens") or 0
