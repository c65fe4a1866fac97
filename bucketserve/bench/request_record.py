"""What the client saw of one request (torch-free)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """Times are `time.perf_counter()` seconds. `output_tokens` is what the client counted
    (gRPC: streamed token ids; OpenAI: the usage chunk, as SSE deltas may merge tokens);
    `server_*` are the server's usage figures."""

    index: int
    tenant: str
    kind: str
    prompt_len: int
    max_tokens: int
    send_time: float = 0.0
    first_token_time: float | None = None
    end_time: float | None = None
    output_tokens: int = 0
    server_prompt_tokens: int | None = None
    server_completion_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    refused: bool = False  # answered at once with RESOURCE_EXHAUSTED / 429 (shed, quota)
    request_bucket: list[int] | None = None
    shape_bucket: list[int] | None = None
    server_timings: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_time is not None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def e2e(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT); 0 for one token."""
        if self.first_token_time is None or self.end_time is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.end_time - self.first_token_time) / (self.output_tokens - 1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}
