"""A pipeline stage that is a tensor-parallel group: the stage's layers sharded over its
ranks, its head rank driving the others as a worker's TensorParallelRunner does."""

from __future__ import annotations

import functools
from typing import Any

import torch

from bucketserve.runtime.distributed.tp_group import TPGroup
from bucketserve.runtime.worker.pipeline.stage import StageDeadError
from bucketserve.runtime.worker.pipeline.stage_runner import StageOutput, StageRunner
from bucketserve.runtime.worker.pipeline.stage_spec import StageSpec
from bucketserve.runtime.worker.pipeline.stage_step import StageStep
from bucketserve.runtime.worker.runner_config import ModelRunnerConfig
from bucketserve.runtime.worker.tensor_parallel.step_seq import StepSeq
from bucketserve.runtime.worker.tensor_parallel.tp_rank import RunnerFactory
from bucketserve.runtime.worker.tensor_parallel.tp_runner import TensorParallelRunner


class TensorParallelStage:
    """What makes a TensorParallelRunner (of processes, or of Ray actors) the head rank of
    one stage: it builds the stage's slice (so does each other rank), and every microbatch
    the stage runs is first sent to the other ranks (its sequences as `StepSeq`s), which
    take the hidden states from this rank by broadcast. A step that fails once the ranks
    have it leaves them out of step: `StageDeadError`, the worker's group goes down."""

    spec: StageSpec

    def _init_head(self, config: ModelRunnerConfig, tp: TPGroup) -> None:
        StageRunner.__init__(self, config, self.spec, tp)

    def _rank_runner(self) -> RunnerFactory:
        return functools.partial(StageRunner, spec=self.spec)

    @torch.inference_mode()
    def run(self, step: StageStep, hidden: torch.Tensor | None) -> StageOutput:
        padded = self._stage_shape(step.pad_to) is not None
        self.inputs.validate(step.seqs, step.num_new_tokens, padded=padded)  # before the ranks
        seqs = [StepSeq(s) for s in step.seqs]
        try:
            self._send("run", StageStep(step.microbatch, seqs, list(step.num_new_tokens),
                                        step.pad_to), None)  # fmt: skip
            return StageRunner.run(self, step, hidden)
        except Exception as exc:
            gone = "a rank is gone" if not self.alive() else "its ranks are out of step"
            raise StageDeadError(
                f"stage {self.spec.index}'s tensor-parallel group failed a step ({gone}): {exc!r}"
            ) from exc

    def info(self) -> dict[str, Any]:
        return {
            **StageRunner.info(self),
            "tensor_parallel_size": self.tensor_parallel_size,
            "rank_pids": self.rank_pids,
        }


class TensorParallelStageRunner(TensorParallelStage, TensorParallelRunner, StageRunner):
    """One stage over `size` ranks: this one (the stage's head, on the stage's thread) and
    `size - 1` spawned processes."""

    def __init__(
        self,
        config: ModelRunnerConfig,
        spec: StageSpec,
        size: int,
        torch_threads: int | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.spec = spec
        TensorParallelRunner.__init__(self, config, size, torch_threads, timeout_s)
