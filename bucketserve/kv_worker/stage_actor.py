"""A pipeline stage as a Ray actor: one card, one slice of layers, their paged KV."""

from __future__ import annotations

from typing import Any

import ray

from bucketserve.kv_worker.worker_env import accelerator_ids, apply_torch_threads, node_id
from bucketserve.runtime.worker.model_runner import ModelRunnerConfig, Shape
from bucketserve.runtime.worker.pipeline.stage_clock import StageSpan
from bucketserve.runtime.worker.pipeline.stage_runner import StageOutput, StageRunner
from bucketserve.runtime.worker.pipeline.stage_spec import StageSpec
from bucketserve.runtime.worker.pipeline.stage_step import StageStep

SIDE = "side"
CONCURRENCY_GROUPS = {SIDE: 1}


class StageActor:
    """Owns a StageRunner. Ray runs its calls one at a time in arrival order, so the
    microbatches a head submits go through it in order; `run`'s `hidden` argument is the
    previous stage's ObjectRef, which Ray resolves from its object store. KV export /
    import and the clock run in their own concurrency group (`SIDE`), beside the
    microbatches: a prefill ships one batch's layers while the next batch computes, and
    they touch other blocks."""

    def __init__(
        self, config: ModelRunnerConfig, spec: StageSpec, torch_threads: int | None
    ) -> None:
        apply_torch_threads(torch_threads)
        self.runner = StageRunner(config, spec)

    def run(self, step: StageStep, hidden: Any) -> StageOutput:
        return self.runner.run(step, hidden)

    def warmup(self, shapes: list[Shape]) -> None:
        self.runner.warmup(shapes)

    def info(self) -> dict:
        return {**self.runner.info(), "node_id": node_id(), "accelerator_ids": accelerator_ids()}

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
