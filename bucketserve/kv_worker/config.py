"""What every KV worker's configuration has: shapes, padding, warm-up, transport, lease."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from bucketserve.bucket_manager.config import ShapeBucketConfig
from bucketserve.runtime.engine.engine_config import ParallelConfig
from bucketserve.utils.settings import Settings


class WorkerSettings(Settings):
    """What the `controller` section gives every worker alike."""

    lease_ttl_s: float = Field(60.0, gt=0)
    """Blocks held for a handoff are freed if not acknowledged within this."""
    pad_to_shape_buckets: Literal["auto"] | bool = "auto"
    """Pad batches to shape buckets: auto (on hpu and cuda, not on CPU), true or false."""
    warmup: Literal["auto", "all", "smallest", "none"] = "auto"
    """Which shape buckets to compile at start (auto: all when padding, else the
    smallest)."""


class WorkerConfig(WorkerSettings, ParallelConfig):
    """One worker actor's configuration, built by the worker pool from a checked
    ControllerConfig: the settings every worker shares, its role's parallelism, and what
    the pool resolves for this actor (`torch_threads` and `cpus`: None leaves the
    process's pool and affinity alone; `transport`; `stage_options`, the Ray options of
    each stage or rank actor, its placement group included: without them the stages are
    threads and the ranks child processes of the worker's process). With
    `pipeline_parallel_size` > 1 the worker is the head of a group of that many stages."""

    name: str = Field("worker-0", exclude=True)
    shape_buckets: ShapeBucketConfig = Field(default_factory=ShapeBucketConfig, exclude=True)
    transport: str = Field("ray", exclude=True)
    torch_threads: int | None = Field(None, exclude=True)
    cpus: list[int] | None = Field(None, exclude=True)
    stage_options: dict[str, Any] | None = Field(None, exclude=True)
