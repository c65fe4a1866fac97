"""The in-process engine's configuration: model runner + scheduler + parallelism."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from bucketserve.runtime.core.scheduler import SchedulerConfig
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.utils.settings import Settings


class ParallelConfig(Settings):
    """How one worker (or the offline engine) splits the model: pipeline stages and
    tensor-parallel ranks (the config file's `controller.prefill` / `controller.decode`
    keys)."""

    pipeline_parallel_size: int = Field(1, ge=1)
    """Pipeline stages per worker: a group of that many stage actors, one card each."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Ranks per worker, each layer sharded over them: a Ray actor per rank, one card each,
    in one placement group (packed as stage_packing says); with pipeline_parallel_size > 1
    each stage is a group of that many ranks (colocated topology only). In the disaggregated
    topology it needs mode ray and the same size for prefill and decode."""


class EngineConfig(ParallelConfig):
    """The continuous-batching engine: its model runner, its scheduler (whose
    `pipeline_depth` sizes the microbatch queue) and its parallelism. Pipeline stages are
    threads of this process (`stage_torch_threads` intra-op threads each), and the queue
    then holds at least one microbatch per stage; tensor-parallel ranks are this process
    (the head: scheduler, block manager, sampling) and spawned processes
    (`stage_torch_threads` intra-op threads each, else the cores shared out). Both > 1:
    each stage is a group of that many ranks, its head on the stage's thread."""

    runner: ModelRunnerConfig = Field(default_factory=ModelRunnerConfig, exclude=True)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, exclude=True)
    stage_torch_threads: int | None = Field(None, ge=1, exclude=True)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Flat keyword arguments (`model=..., max_num_seqs=..., pipeline_depth=...`) sorted
        into the component configs; an unknown name raises ValueError listing the known."""
        parts: dict[str, dict[str, Any]] = {"runner": {}, "scheduler": {}, "engine": {}}
        owners = {
            **dict.fromkeys(ModelRunnerConfig.model_fields, "runner"),
            **dict.fromkeys(SchedulerConfig.model_fields, "scheduler"),
            **dict.fromkeys(("stage_torch_threads", *ParallelConfig.model_fields), "engine"),
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
