"""A pipeline stage as a Ray actor: one card, one slice of layers, their paged KV; or the
head rank of a stage that is a tensor-parallel group, its other ranks RankActors."""

from __future__ import annotations

from typing import Any

import ray

from bucketserve.kv_worker.rank_actor import RayTensorParallelRunner
from bucketserve.kv_worker.worker_env import accelerator_ids, apply_torch_threads, node_id
from bucketserve.runtime.worker.model_runner import Shape
from bucketserve.runtime.worker.pipeline.stage_clock import StageSpan
from bucketserve.runtime.worker.pipeline.stage_runner import StageOutput, StageRunner
from bucketserve.runtime.worker.pipeline.stage_spec import StageSpec
from bucketserve.runtime.worker.pipeline.stage_step import StageStep
from bucketserve.runtime.worker.pipeline.tp_stage import TensorParallelStage
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

SIDE = "side"
CONCURRENCY_GROUPS = {SIDE: 1}


def stage_bundle(index: int, tensor_parallel_size: int) -> int:
    """The placement-group bundle of stage `index`'s actor (its head rank); bundle 0 is the
    worker's, and each stage's ranks follow its own, one card each."""
    return 1 + index * tensor_parallel_size


class RayTensorParallelStageRunner(TensorParallelStage, RayTensorParallelRunner, StageRunner):
    """One stage over `size` ranks: the StageActor's process (the head) and `size - 1`
    RankActors in the bundles after the stage's own (`options["placement_group"]`)."""

    def __init__(
        self,
        config: ModelRunnerConfig,
        spec: StageSpec,
        size: int,
        options: dict[str, Any],
        torch_threads: int | None,
        name: str,
    ) -> None:
        self.spec = spec
        self._first_bundle = stage_bundle(spec.index, size)
        RayTensorParallelRunner.__init__(self, config, size, options, torch_threads, name)

    def _bundle_index(self, rank: int) -> int:
        return self._first_bundle + rank


class StageActor:
    """Owns a StageRunner. Ray runs its calls one at a time in arrival order, so the
    microbatches a head submits go through it in order; `run`'s `hidden` argument is the
    previous stage's ObjectRef, which Ray resolves from its object store. KV export /
    import and the clock run in their own concurrency group (`SIDE`), beside the
    microbatches: a prefill ships one batch's layers while the next batch computes, and
    they touch other blocks. With `tensor_parallel_size` > 1 the runner is the head rank
    of the stage's group (`rank_options`: each other rank's Ray options, with the worker's
    placement group)."""

    def __init__(
        self,
        config: ModelRunnerConfig,
        spec: StageSpec,
        torch_threads: int | None,
        tensor_parallel_size: int = 1,
        rank_options: dict[str, Any] | None = None,
        name: str = "stage",
    ) -> None:
        apply_torch_threads(torch_threads)
        if tensor_parallel_size > 1:
            self.runner: StageRunner = RayTensorParallelStageRunner(
                config, spec, tensor_parallel_size, rank_options or {}, torch_threads, name
            )
        else:
            self.runner = StageRunner(config, spec)

    def run(self, step: StageStep, hidden: Any) -> StageOutput:
        return self.runner.run(step, hidden)

    def warmup(self, shapes: list[Shape]) -> None:
        self.runner.warmup(shapes)

    def info(self) -> dict:
        info = {**self.runner.info(), "node_id": node_id(), "accelerator_ids": accelerator_ids()}
        if isinstance(self.runner, RayTensorParallelStageRunner):
            info["ranks"] = self.runner.rank_infos
        return info

    @ray.method(concurrency_group=SIDE)
    def export_blocks(self, layer: int, block_ids: list[int]) -> Any:
        return self.runner.export_blocks(layer, block_ids)

    @ray.method(concurrency_group=SIDE)
    def import_blocks(self, layer: int, block_ids: list[int], data: Any) -> None:
        self.runner.import_blocks(layer, block_ids, data)

    @ray.method(concurrency_group=SIDE)
    def clock(self, spans: bool) -> tuple[float, int, list[StageSpan]]:
        return self.runner.clock.snapshot(spans)

    def ping(self) -> int:
        return self.runner.spec.index
