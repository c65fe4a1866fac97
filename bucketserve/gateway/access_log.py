"""One log line per request on the `bucketserve.access` logger: who, which request, how
it ended, its tokens and its latency. Prompt text only when the config asks for it."""

from __future__ import annotations

import logging
import time
from typing import Any

from aiohttp import web

from bucketserve.gateway.generation import Generation

# what an HTTP handler leaves on its request for the access log
TENANT = web.RequestKey("tenant", str)
GENERATION = web.RequestKey("generation", Generation)
logger = logging.getLogger("bucketserve.access")
QUIET_PATHS = ("/metrics", "/health")  # scraped every few seconds: debug level
MAX_PROMPT_CHARS = 2000


class AccessLog:
    def __init__(self, log_prompts: bool = False) -> None:
        self.log_prompts = log_prompts

    def record(
        self,
        route: str,
        status: int | str,
        started: float,
        tenant: str | None = None,
        gen: Generation | None = None,
    ) -> None:
        level = logging.DEBUG if route.endswith(QUIET_PATHS) else logging.INFO
        if not logger.isEnabledFor(level):
            return
        now = time.monotonic()
        fields: dict[str, Any] = {"route": route, "status": status, "tenant": tenant}
        if gen is not None:
            fields |= self._generation(gen, started)
        fields["total_ms"] = round((now - started) * 1000, 1)
        line = " ".join(f"{k}={v}" for k, v in fields.items() if k != "prompt")
        if "prompt" in fields:
            line += f" prompt={fields['prompt']!r}"
        logger.log(level, "%s", line, extra={"fields": fields})

    def _generation(self, gen: Generation, started: float) -> dict[str, Any]:
        first = gen.first_token_time
        fields: dict[str, Any] = {
            "tenant": gen.tenant.name,
            "request_id": gen.request_id,
            "finish": gen.final.finish_reason if gen.final is not None else "aborted",
            "prompt_tokens": len(gen.request.prompt_token_ids),
            "output_tokens": gen.num_output_tokens,
            "ttft_ms": None if first is None else round((first - started) * 1000, 1),
            "cached_tokens": gen.final.num_cached_tokens if gen.final is not None else None,
            "prefill": gen.final.prefill_path if gen.final is not None else None,
        }
        if self.log_prompts and gen.request.prompt_text is not None:
            fields["prompt"] = gen.request.prompt_text[:MAX_PROMPT_CHARS]
        return fields
