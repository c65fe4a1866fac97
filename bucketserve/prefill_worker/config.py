"""PrefillWorker's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from bucketserve.kv_worker.config import WorkerConfig
from bucketserve.runtime.worker.model_runner import ModelRunnerConfig


@dataclass
class PrefillWorkerConfig(WorkerConfig):
    """`shape_buckets` holds the prompt shapes this worker warms and pads to. Blocks of a
    finished batch stay held under a lease until the decode side acknowledges.
    `enable_prefix_caching`: computed full blocks stay cached (an LRU of free blocks), so a
    later prompt with the same leading blocks computes only the rest."""

    name: str = "prefill-0"
    runner: ModelRunnerConfig = field(default_factory=ModelRunnerConfig)
    enable_prefix_caching: bool = True
