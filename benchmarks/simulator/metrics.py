"""Per-request records and what a run reports: throughput, latency percentiles, SLOs."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    prefill_start: float | None = None
    decode_start: float | None = None  # KV landed on the decode worker
    preemptions: int = 0

    @property
    def ttft(self) -> float:
        return math.inf if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        if self.finish is None or self.first_token is None:
            return math.inf
        return (self.finish - self.first_token) / max(1, self.output_len - 1)

    @property
    def e2e(self) -> float:
        return math.inf if self.finish is None else self.finish - self.arrival


@dataclass(frozen=True)
class SloConfig:
    ttft_s: float = 2.0
    tpot_s: float = 0.2

    def met(self, record: RequestRecord) -> bool:
        return record.ttft <= self.ttft_s and record.tpot <= self.tpot_s


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": statistics.median(ordered), "p90": at(0.90), "p99": at(0.99)}


@dataclass
class RunResult:
    """A run's records plus the simulator's own counters (`stats`)."""

    system: str
    records: list[RequestRecord]
    num_workers: int  # prefill + decode workers, or replicas
    busy_s: float  # worker-seconds spent computing
    sim_end: float
    stats: dict = field(default_factory=dict)

    @property
    def finished(self) -> list[RequestRecord]:
        return [r for r in self.records if r.finish is not None]

    @property
    def makespan(self) -> float:
        first = min(r.arrival for r in self.records)
        last = max((r.finish for r in self.finished), default=first)
        return max(last - first, 1e-12)

    def summary(self, slo: SloConfig | None = None) -> dict:
        done = self.finished
        span = self.makespan
        out_tokens = sum(r.output_len for r in done)
        total_tokens = out_tokens + sum(r.prompt_len for r in done)
        report = {
            "system": self.system,
            "requests": len(self.records),
            "finished": len(done),
            "makespan_s": span,
            "server_rps": len(done) / span,
            "output_tok_s": out_tokens / span,
            "total_tok_s": total_tokens / span,
            "utilization": self.busy_s / (self.num_workers * span),
            "ttft_s": percentiles([r.ttft for r in done]),
            "tpot_s": percentiles([r.tpot for r in done]),
            "e2e_s": percentiles([r.e2e for r in done]),
            **self.stats,
        }
        if slo is not None:
            met = sum(slo.met(r) for r in self.records)
            report["slo_attainment"] = met / len(self.records)
            report["goodput_rps"] = met / span
        return report
