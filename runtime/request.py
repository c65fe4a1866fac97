"""What flows between the gateway and the serving controller (torch-free).

The gateway validates and tokenizes, then hands a `ServeRequest` to
`Controller.submit()`; the controller yields `StreamDelta`s back, the last
one with `finished=True`. Every admitted request gets exactly one final delta.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from runtime.sampling_params import SamplingParams


@dataclass
class ServeRequest:
    """A tokenized, validated request. `arrival_time` is `time.monotonic()`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    tenant: str = "default"
    priority: int = 0  # lower is served first, as in vLLM
    prompt_text: str | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass
class RequestTimings:
    """Seconds spent in each stage; filled in as the request moves on."""

    queue_s: float = 0.0  # arrival until its prefill batch was dispatched
    prefill_s: float = 0.0  # the prefill batch's compute
    transfer_s: float = 0.0  # moving its KV blocks to the decode worker
    first_token_s: float = 0.0  # arrival until the first token reached the controller (TTFT)
    decode_s: float = 0.0  # first token until the last


@dataclass
class StreamDelta:
    """New tokens of one request since its previous delta.

    The final delta has `finished=True`, a `finish_reason` (stop / length /
    cancelled / error), usage counts, timings and the buckets that served it;
    `error` says what went wrong when the reason is `error`.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: RequestTimings | None = None
    request_bucket: tuple[int, int] | None = None  # [low, up) prompt-length range
    shape_bucket: tuple[int, int, int] | None = None  # (batch, query, blocks) of its prefill


class ServiceError(Exception):
    """An admission failure the gateway maps to a status code."""


class QueueFullError(ServiceError):
    """The service queue is at its bound (RESOURCE_EXHAUSTED / HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoWorkersError(ServiceError):
    """No live prefill or decode worker can take the request (UNAVAILABLE / HTTP 503)."""
