"""What every KV worker's configuration has: shapes, padding, warm-up, transport, lease."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bucketserve.bucket_manager.config import ShapeBucketConfig


@dataclass
class WorkerConfig:
    """`pad_to_shape_buckets`: "auto" pads on hpu / cuda (fixed-shape graphs) and not on cpu.
    `warmup`: "auto" runs every shape when padding, else only the smallest; "all",
    "smallest" or "none" force a choice. Blocks held for a handoff are freed after
    `lease_ttl_s` at most. `pipeline_parallel_size` > 1 makes the worker the head of a
    group of that many stages; `stage_options` (set by the worker pool on Ray) are the Ray
    options of each stage actor, its placement group included; without them the stages
    are threads of the worker's process. The worker pool builds it from a checked
    ControllerConfig."""

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
