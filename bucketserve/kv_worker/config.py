"""What every KV worker's configuration has: shapes, padding, warm-up, transport, lease."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bucketserve.bucket_manager.config import ShapeBucketConfig
from bucketserve.kv_transfer.transport import check_transport
from bucketserve.kv_worker.worker_env import check_cpus, check_worker_options


@dataclass
class WorkerConfig:
    """`pad_to_shape_buckets`: "auto" pads on hpu / cuda (fixed-shape graphs) and not on cpu.
    `warmup`: "auto" runs every shape when padding, else only the smallest; "all",
    "smallest" or "none" force a choice. Blocks held for a handoff are freed after
    `lease_ttl_s` at most. `pipeline_parallel_size` > 1 makes the worker the head of a
    group of that many stages; `stage_options` (set by the worker pool on Ray) are the Ray
    options of each stage actor, its placement group included; without them the stages
    are threads of the worker's process."""

    name: str = "worker-0"
    shape_buckets: ShapeBucketConfig = field(default_factory=ShapeBucketConfig)
    pad_to_shape_buckets: str | bool = "auto"
    warmup: str = "auto"
    transport: str = "ray"
    lease_ttl_s: float = 60.0
    torch_threads: int | None = None
    cpus: list[int] | None = None
    pipeline_parallel_size: int = 1
    stage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        where = type(self).__name__
        check_cpus(f"{where}.cpus", self.cpus)
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"{where}.name must be a non-empty str, got {self.name!r}")
        check_worker_options(where, self.pad_to_shape_buckets, self.warmup, self.torch_threads)
        check_transport(self.transport)
        self._check_number("lease_ttl_s", positive=True)
        pp = self.pipeline_parallel_size
        if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
            raise ValueError(f"{where}.pipeline_parallel_size must be an integer >= 1, got {pp!r}")

    def _check_number(self, name: str, positive: bool) -> None:
        value = getattr(self, name)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not (value > 0 if positive else value >= 0):
            bound = "> 0" if positive else ">= 0"
            where = type(self).__name__
            raise ValueError(f"{where}.{name} must be a number {bound}, got {value!r}")
