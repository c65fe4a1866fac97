"""PrefillWorker's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketserve.kv_worker.config import WorkerConfig
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    """`shape_buckets` holds the prompt shapes this worker warms and pads to. Blocks of a
    finished batch stay held under a lease until the decode side acknowledges.
    `tensor_parallel_size` > 1 shards the model over that many ranks (RankActors with
    `stage_options`, else this process's children), each shipping its KV heads to the
    decode worker's rank of its index."""

    name: str = "prefill-0"
    runner: ModelRunnerConfig = field(default_factory=ModelRunnerConfig)
    # fault drill (tests only, no config key): the first life of the worker dies with its
    # first batch's KV that many layers out (0: before any)
    exit_after_layers: int | None = None
    cache_shares: dict[str, float] | None = None  # tenant -> bound on evictable blocks
    tensor_parallel_size: int = 1
