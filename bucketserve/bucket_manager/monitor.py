"""What the gateway exports: a plain snapshot of queues, buckets and padding waste."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bucketserve.bucket_manager.prefill_batch import PrefillBatch


@dataclass(frozen=True)
class BucketMetrics:
    num_buckets: int
    boundaries: list[int]
    splits: int
    merges: int
    n_max: int
    queued: int
    queue_by_bucket: list[dict[str, Any]]  # {"low", "up", "queued", "by_tenant": {name: n}}
    queue_by_tenant: dict[str, int]
    tokens_served_by_tenant: dict[str, float]
    expected_waste: float  # Eq. 3 over the queued lengths and current boundaries
    batches: int
    requeued_batches: int
    last_waste_ratio: float  # Eq. 2 of the latest batch
    mean_waste_ratio: float
    mean_padded_waste: float  # Eq. 2 against the padded query length, per batch
    mean_shape_waste: float  # padding share of the padded shapes, batch rows included
    graph_misses: int
    prompt_tokens: int  # of the formed batches
    padded_tokens: int  # their forwards' tokens, padding included
    computed_tokens: int = 0  # their prompt tokens less the cached prefixes expected

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BucketMonitor:
    """Running totals over formed batches; a re-queued batch is taken back out."""

    batches: int = 0
    requeued_batches: int = 0
    graph_misses: int = 0
    last_waste_ratio: float = 0.0
    prompt_tokens: int = 0
    padded_tokens: int = 0
    computed_tokens: int = 0
    _waste_sum: float = field(default=0.0, repr=False)
    _padded_sum: float = field(default=0.0, repr=False)
    _shape_sum: float = field(default=0.0, repr=False)

    def record(self, batch: PrefillBatch) -> None:
        self._add(batch, 1)
        self.last_waste_ratio = batch.waste_ratio

    def unrecord(self, batch: PrefillBatch) -> None:
        self._add(batch, -1)
        self.requeued_batches += 1

    def _add(self, batch: PrefillBatch, sign: int) -> None:
        self.batches += sign
        self.graph_misses += sign * batch.graph_miss
        self.prompt_tokens += sign * batch.prompt_tokens
        self.padded_tokens += sign * batch.padded_tokens
        self.computed_tokens += sign * batch.computed_tokens
        self._waste_sum += sign * batch.waste_ratio
        self._padded_sum += sign * batch.padded_waste
        self._shape_sum += sign * batch.shape_waste

    @property
    def mean_waste_ratio(self) -> float:
        return self._mean(self._waste_sum)

    @property
    def mean_padded_waste(self) -> float:
        return self._mean(self._padded_sum)

    @property
    def mean_shape_waste(self) -> float:
        return self._mean(self._shape_sum)

    def _mean(self, total: float) -> float:
        return total / self.batches if self.batches else 0.0
