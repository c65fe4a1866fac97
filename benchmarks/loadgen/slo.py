"""The latency targets a request is judged against (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.loadgen.request_record import RequestRecord


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be > 0 seconds, got TTFT {self.ttft_s}, "
                             f"TPOT {self.tpot_s}")

    def met(self, record: RequestRecord) -> bool:
        """Finished without error, first token within TTFT and mean gap within TPOT."""
        if not record.ok or record.ttft is None:
            return False
        return record.ttft <= self.ttft_s and (record.tpot or 0.0) <= self.tpot_s
