"""A worker's stage group on Ray: one StageActor per card, in the worker's placement group."""

from __future__ import annotations

import logging
import os
from typing import Any

from bucketserve.kv_worker.rank_actor import RayTensorParallelRunner
from bucketserve.kv_worker.stage_actor import CONCURRENCY_GROUPS, StageActor, stage_bundle
from bucketserve.runtime.worker.model_runner import ModelRunner, Shape
from bucketserve.runtime.worker.pipeline.pipeline_runner import PipelineRunner
from bucketserve.runtime.worker.pipeline.stage import StageDeadError
from bucketserve.runtime.worker.pipeline.stage_clock import StageSpan
from bucketserve.runtime.worker.pipeline.stage_spec import StageSpec
from bucketserve.runtime.worker.pipeline.stage_step import StageStep
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.tensor_parallel.tp_runner import TensorParallelRunner

logger = logging.getLogger(__name__)


def new_runner(
    config: ModelRunnerConfig,
    num_stages: int,
    stage_options: dict[str, Any] | None,
    torch_threads: int | None,
    name: str,
    tensor_parallel_size: int = 1,
) -> ModelRunner | PipelineRunner:
    """One runner (1 stage), stages on threads (no Ray placement: local mode) or one
    StageActor per stage (`stage_options`: the Ray options of each, see RayStage); with
    `tensor_parallel_size` > 1 and one stage, the head rank of a tensor-parallel group
    whose other ranks are RankActors (`stage_options`: the Ray options of each) or,
    without them (local mode), this process's children sharing out its `torch_threads`;
    with both, stages each of which is such a group (its head the stage)."""
    tp = tensor_parallel_size
    if tp > 1 and num_stages == 1 and stage_options is not None:
        return RayTensorParallelRunner(config, tp, stage_options, torch_threads, name)
    if tp > 1 and num_stages == 1:
        threads = torch_threads and max(1, torch_threads // tp)
        return TensorParallelRunner(config, tp, threads)
    if num_stages == 1:
        return ModelRunner(config)
    if stage_options is None:
        threads = torch_threads and max(1, torch_threads // (num_stages * tp))
        return PipelineRunner.local(config, num_stages, threads if tp > 1 else torch_threads, tp)

    def make(cfg: ModelRunnerConfig, spec: StageSpec) -> RayStage:
        return RayStage(cfg, spec, stage_options, torch_threads, name, tp)

    return PipelineRunner(config, num_stages, make)


class RayStage:
    """The head's side of one StageActor (bucketserve.runtime.worker.pipeline.stage.Stage).
    Stage s sits in bundle s + 1 of the group's placement group (bundle 0 is the head's);
    with `tensor_parallel_size` T, in bundle 1 + s * T, its other ranks in the T - 1 after
    it. A stage that is gone, or whose tensor-parallel group failed a step
    (StageDeadError), takes its group down: the head's process exits, so Ray restarts the
    worker, which starts a fresh group with every stage and rank, and the controller
    re-prefills its requests as for any dead worker."""

    def __init__(
        self,
        config: ModelRunnerConfig,
        spec: StageSpec,
        options: dict[str, Any],
        torch_threads: int | None,
        group: str,
        tensor_parallel_size: int = 1,
    ) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.spec = spec
        opts = {k: v for k, v in options.items() if k != "placement_group"}
        pg = options.get("placement_group")
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=stage_bundle(spec.index, tensor_parallel_size)
            )
        self.name = f"{group}-stage{spec.index}-{os.getpid()}"
        self._clock_ref: Any = None
        self._last_clock: tuple[float, int, list[StageSpan]] = (0.0, 0, [])
        self.actor = (
            ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(StageActor)
            .options(name=self.name, max_restarts=0, max_task_retries=0, **opts)
            .remote(config, spec, torch_threads, tensor_parallel_size, options, self.name)
        )

    def submit(self, step: StageStep, prev: Any) -> Any:
        return self.actor.run.remote(step, prev)

    def wait(self, handle: Any) -> None:
        """Until the stage is done with it; its hidden states stay in the object store for
        the next stage (an error surfaces from the last stage's result)."""
        import ray

        ray.wait([handle], fetch_local=False)

    def done(self, handle: Any, timeout_s: float) -> bool:
        import ray

        ready, _ = ray.wait([handle], timeout=timeout_s)
        return bool(ready)

    def result(self, handle: Any) -> Any:
        return self._get(handle)

    def warmup(self, shapes: list[Shape]) -> None:
        self._get(self.actor.warmup.remote(shapes))

    def info(self) -> dict:
        return {**self._get(self.actor.info.remote()), "actor": self.name}

    def export_blocks(self, layer: int, block_ids: list[int]) -> Any:
        return self._get(self.actor.export_blocks.remote(layer, block_ids))

    def import_blocks(self, layer: int, block_ids: list[int], data: Any) -> None:
        self._get(self.actor.import_blocks.remote(layer, block_ids, data))

    def clock(self, spans: bool, fresh: bool) -> tuple[float, int, list[StageSpan]]:
        """The stage's clock; without `fresh` the last report, asking for the next one
        without waiting (a clock call queues behind the stage's microbatches)."""
        import ray

        if fresh or spans:
            return self._get(self.actor.clock.remote(spans))
        if self._clock_ref is not None and ray.wait([self._clock_ref], timeout=0)[0]:
            self._last_clock = self._get(self._clock_ref)
            self._clock_ref = None
        if self._clock_ref is None:
            self._clock_ref = self.actor.clock.remote(False)
        return self._last_clock

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def _get(self, ref: Any) -> Any:
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayError as exc:
            if _is_death(exc):
                _take_group_down(self.name, exc)
            raise


def _is_death(exc: BaseException) -> bool:
    import ray

    if isinstance(exc, StageDeadError):  # a stage's tensor-parallel group cannot go on
        return True
    if isinstance(exc, ray.exceptions.RayTaskError):
        return _is_death(exc.cause) if isinstance(exc.cause, BaseException) else False
    return isinstance(
        exc, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError,
              ray.exceptions.ActorUnavailableError)
    )


def _take_group_down(stage: str, exc: BaseException) -> None:
    logger.error("stage actor %s is gone (%r); the stage group goes down with it", stage, exc)
    logging.shutdown()
    os._exit(1)
