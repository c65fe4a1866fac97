"""The latency targets a request is judged against (torch-free)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from bucketserve.bench.request import REQUEST_KINDS
from bucketserve.bench.request_record import RequestRecord


@dataclass(frozen=True)
class SLO:
    """TTFT and TPOT targets, seconds. `per_kind` gives one workload kind its own
    (TTFT, TPOT), as a service gives an offline tenant relaxed targets (the tenants'
    `ttft_slo_s` / `tpot_slo_s`). Kinds, not tenants, so that the same request is judged
    alike by every system a comparison runs, whatever tenant each maps it to."""

    ttft_s: float
    tpot_s: float
    per_kind: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind, (ttft, tpot) in {"": (self.ttft_s, self.tpot_s), **self.per_kind}.items():
            if not (ttft > 0 and tpot > 0):
                where = f" for {kind} requests" if kind else ""
                raise ValueError(f"SLO targets{where} must be > 0 seconds, got TTFT {ttft}, "
                                 f"TPOT {tpot}")
        bad = sorted(set(self.per_kind) - set(REQUEST_KINDS))
        if bad:
            raise ValueError(f"per-kind SLO targets are for the kinds {REQUEST_KINDS}, got {bad}")

    @property
    def uniform(self) -> SLO:
        """The base targets for every request, no kind set apart."""
        return SLO(self.ttft_s, self.tpot_s)

    def targets(self, kind: str) -> tuple[float, float]:
        return self.per_kind.get(kind, (self.ttft_s, self.tpot_s))

    def met(self, record: RequestRecord) -> bool:
        """Finished without error, first token within TTFT and mean gap within TPOT."""
        if not record.ok or record.ttft is None:
            return False
        ttft, tpot = self.targets(record.kind)
        return record.ttft <= ttft and (record.tpot or 0.0) <= tpot
