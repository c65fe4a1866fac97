"""PrefillWorker's configuration."""

from __future__ import annotations

from pydantic import Field

from bucketserve.kv_worker.config import WorkerConfig
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig


class PrefillWorkerConfig(WorkerConfig):
    """`shape_buckets` holds the prompt shapes this worker warms and pads to. Blocks of a
    finished batch stay held under a lease until the decode side acknowledges.
    `tensor_parallel_size` > 1 shards the model over that many ranks (RankActors with
    `stage_options`, else this process's children), each shipping its KV heads to the
    decode worker's rank of its index. `cache_shares`: tenant -> bound on evictable
    blocks. `exit_after_layers`, a fault drill for tests: the first life of the worker
    dies with its first batch's KV that many layers out (0: before any)."""

    name: str = Field("prefill-0", exclude=True)
    runner: ModelRunnerConfig = Field(default_factory=ModelRunnerConfig, exclude=True)
    exit_after_layers: int | None = Field(None, exclude=True)
    cache_shares: dict[str, float] | None = Field(None, exclude=True)
