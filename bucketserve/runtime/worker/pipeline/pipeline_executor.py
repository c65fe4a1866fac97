"""The microbatch queue over a stage group: the pipeline-parallel RFC's executor."""

from __future__ import annotations

import threading
from collections.abc import Callable

from bucketserve.runtime.core.executor import Executor
from bucketserve.runtime.core.scheduler_output import SchedulerOutput
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.worker.model_runner import Shape
from bucketserve.runtime.worker.pipeline.pipeline_runner import Microbatch, PipelineRunner
from bucketserve.runtime.worker.pipeline.stage import StageDeadError

PadFn = Callable[[list[Sequence], list[int]], "Shape | None"]


class PipelineExecutor(Executor):
    """`Executor` over a PipelineRunner: `submit` returns as soon as the microbatch is on
    its way down the stages, so up to `depth` (by default one per stage) run at once;
    `finish` takes the oldest. A dead stage is not a failed batch: StageDeadError goes
    through to the worker, whose whole group is restarted."""

    passthrough = (StageDeadError,)

    def __init__(self, runner: PipelineRunner, pad_fn: PadFn | None, depth: int) -> None:
        super().__init__(None, depth)
        self.runner = runner
        self.pad_fn = pad_fn

    def wait(self, wake: threading.Event, poll_s: float = 0.002) -> bool:
        """Until the oldest microbatch is done (True) or `wake` is set first (False): the
        loop's other event, a request that can be scheduled now."""
        _, microbatch = self._queue[0]
        stage = self.runner.num_stages - 1
        while not wake.is_set():
            if self.runner.stages[stage].done(microbatch.handles[stage], poll_s):
                return True
        return False

    def shutdown(self) -> None:
        self.runner.shutdown()

    def _start(self, batch: SchedulerOutput) -> Microbatch:
        seqs, counts = batch.seqs, batch.num_new_tokens
        pad_to = None if self.pad_fn is None else self.pad_fn(seqs, counts)
        return self.runner.submit(seqs, counts, pad_to)

    def _result(self, handle: Microbatch) -> list[int | None]:
        return self.runner.result(handle)


def make_executor(runner, pad_fn: PadFn | None, depth: int, execute) -> Executor | PipelineExecutor:
    """The engine's microbatch queue: over a stage group, at least one microbatch per stage;
    otherwise today's executor (`execute` runs a batch)."""
    if isinstance(runner, PipelineRunner):
        return PipelineExecutor(runner, pad_fn, max(depth, runner.num_stages))
    return Executor(execute, depth)
