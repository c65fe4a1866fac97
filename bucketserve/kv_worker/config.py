"""What every KV worker's configuration has: shapes, padding, warm-up, transport, lease."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import Ge
from pydantic import AfterValidator, Field

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


def _core_ids(cpus: list[int] | None) -> list[int] | None:
    if cpus is not None and (not cpus or len(set(cpus)) != len(cpus)):
        raise ValueError(f"must be null or a list of distinct core ids >= 0; got {cpus!r}")
    return cpus


class ProcessSettings(Settings):
    """A worker actor's process: its intra-op threads and the cores it runs on."""

    torch_threads: int | None = Field(None, ge=1)
    """Intra-op threads per actor; null: all the node's cores, or len(cpus)."""
    cpus: Annotated[list[Annotated[int, Ge(0)]] | None, AfterValidator(_core_ids)] = None
    """Pin each actor to these core ids, e.g. [0]; disjoint lists per role partition one
    machine."""


class WorkerConfig(WorkerSettings, ParallelConfig, ProcessSettings):
    """One worker actor's configuration, built by the worker pool from a checked
    ControllerConfig: the settings every worker shares, its role's parallelism and
    process settings (`torch_threads` and `cpus` as the pool resolved them for this actor:
    None leaves the process's thread pool and affinity alone), and the actor's own
    `name`, KV `transport` and `stage_options` (the Ray options of each stage or rank
    actor, its placement group included: without them the stages are threads and the
    ranks child processes of the worker's process). With `pipeline_parallel_size` > 1 the
    worker is the head of a group of that many stages."""

    name: str = Field("worker-0", exclude=True)
    shape_buckets: ShapeBucketConfig = Field(default_factory=ShapeBucketConfig, exclude=True)
    transport: str = Field("ray", exclude=True)
    stage_options: dict[str, Any] | None = Field(None, exclude=True)
