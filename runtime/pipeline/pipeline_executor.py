"""The microbatch queue over a stage group: the pipeline-parallel RFC's executor."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from runtime.executor import ExecutionError, Executor
from runtime.model_runner import Shape
from runtime.pipeline.pipeline_runner import Microbatch, PipelineRunner
from runtime.pipeline.stage import StageDeadError
from runtime.scheduler import SchedulerOutput
from runtime.sequence import Sequence

PadFn = Callable[[list[Sequence], list[int]], "Shape | None"]


class PipelineExecutor:
    """`Executor`'s interface over a PipelineRunner: `submit` returns as soon as the
    microbatch is on its way down the stages, so up to `depth` (by default one per
    stage) run at once; `finish` takes the oldest. A dead stage is not a failed batch:
    StageDeadError goes through to the worker, whose whole group is restarted."""

    def __init__(self, runner: PipelineRunner, pad_fn: PadFn | None, depth: int) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"pipeline depth must be a positive integer, got {depth!r}")
        self.runner = runner
        self.pad_fn = pad_fn
        self.depth = depth
        self._queue: deque[tuple[SchedulerOutput, Microbatch]] = deque()
        self.peak_in_flight = 0

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> list[SchedulerOutput]:
        return [batch for batch, _ in self._queue]

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.depth

    def submit(self, batch: SchedulerOutput) -> None:
        if self.full:
            raise RuntimeError(f"microbatch queue is full ({self.depth}); finish() one first")
        seqs, counts = batch.seqs, batch.num_new_tokens
        pad_to = None if self.pad_fn is None else self.pad_fn(seqs, counts)
        self._queue.append((batch, self.runner.submit(seqs, counts, pad_to)))
        self.peak_in_flight = max(self.peak_in_flight, len(self._queue))

    def wait(self, wake: threading.Event, poll_s: float = 0.002) -> bool:
        """Until the oldest microbatch is done (True) or `wake` is set first (False): the
        loop's other event, a request that can be scheduled now."""
        _, microbatch = self._queue[0]
        stage = self.runner.num_stages - 1
        while not wake.is_set():
            if self.runner.stages[stage].done(microbatch.handles[stage], poll_s):
                return True
        return False

    def finish(self) -> tuple[SchedulerOutput, list[int | None]]:
        if not self._queue:
            raise RuntimeError("no microbatch in flight")
        batch, microbatch = self._queue.popleft()
        try:
            return batch, self.runner.result(microbatch)
        except StageDeadError:
            raise
        except Exception as exc:
            raise ExecutionError(batch, exc) from exc

    def shutdown(self) -> None:
        self.runner.shutdown()


def make_executor(runner, pad_fn: PadFn | None, depth: int, execute) -> Executor | PipelineExecutor:
    """The engine's microbatch queue: over a stage group, at least one microbatch per stage;
    otherwise today's executor (`execute` runs a batch)."""
    if isinstance(runner, PipelineRunner):
        return PipelineExecutor(runner, pad_fn, max(depth, runner.num_stages))
    return Executor(execute, depth)
