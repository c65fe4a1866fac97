"""The in-process engine's configuration: model runner + scheduler + pipeline depth."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bucketserve.runtime.core.scheduler import SchedulerConfig
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig


@dataclass
class EngineConfig:
    """`pipeline_depth` is the microbatch queue's size (1 = synchronous steps).
    `pipeline_parallel_size` splits the layers over that many stages (threads of this
    process, `stage_torch_threads` intra-op threads each); the queue then holds at least
    one microbatch per stage. `tensor_parallel_size` shards every layer over that many
    ranks: this process (the head: scheduler, block manager, sampling) and spawned
    processes (`stage_torch_threads` intra-op threads each, else the cores shared out).
    Both > 1: each stage is a group of that many ranks, its head on the stage's thread."""

    runner: ModelRunnerConfig = field(default_factory=ModelRunnerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    pipeline_depth: int = 1
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    stage_torch_threads: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pipeline_depth, int) or self.pipeline_depth < 1:
            raise ValueError(
                f"pipeline_depth must be a positive integer, got {self.pipeline_depth!r}"
            )
        pp = self.pipeline_parallel_size
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ValueError(f"pipeline_parallel_size must be a positive integer, got {pp!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        threads = self.stage_torch_threads
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError(f"stage_torch_threads must be None or >= 1, got {threads!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Flat keyword arguments (`model=..., max_num_seqs=..., pipeline_depth=...`) sorted
        into the component configs; an unknown name raises ValueError listing the known."""
        parts: dict[str, dict[str, Any]] = {"runner": {}, "scheduler": {}, "engine": {}}
        owners = {
            **dict.fromkeys(ModelRunnerConfig.model_fields, "runner"),
            **dict.fromkeys(SchedulerConfig.model_fields, "scheduler"),
            "pipeline_depth": "engine",
            "pipeline_parallel_size": "engine",
            "tensor_parallel_size": "engine",
            "stage_torch_threads": "engine",
        }
        unknown = sorted(set(kwargs) - set(owners))
        if unknown:
            raise ValueError(
                f"unknown engine option(s) {unknown}; known options: {sorted(owners)}"
            )
        for name, value in kwargs.items():
            parts[owners[name]][name] = value
        return cls(
            runner=ModelRunnerConfig(**parts["runner"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            **parts["engine"],
        )
