"""The microbatch queue between the engine loop and the model runner."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from runtime.scheduler import SchedulerOutput
from runtime.sequence import Sequence

ExecuteFn = Callable[[list[Sequence], list[int]], list[int | None]]


class ExecutionError(RuntimeError):
    """The model runner failed on `batch`; the engine ends its sequences with an error."""

    def __init__(self, batch: SchedulerOutput, cause: Exception) -> None:
        super().__init__(f"executing a microbatch of {len(batch)} sequences failed: {cause!r}")
        self.batch = batch
        self.cause = cause


class Executor:
    """Runs submitted microbatches in order; at most `depth` are in flight.

    Depth 1 is synchronous: `submit` runs the batch and `finish` returns it.
    With depth > 1 batches run one after another on a worker thread, so the
    engine can schedule and submit the next microbatch while one executes
    (the pipeline-parallel RFC's two-stage loop).
    """

    def __init__(self, execute: ExecuteFn, depth: int = 1) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"pipeline depth must be a positive integer, got {depth!r}")
        self.execute = execute
        self.depth = depth
        self._queue: deque[tuple[SchedulerOutput, Future[list[int | None]]]] = deque()
        self._worker = ThreadPoolExecutor(1, "executor") if depth > 1 else None

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> list[SchedulerOutput]:
        """Submitted microbatches not finished yet, oldest first."""
        return [batch for batch, _ in self._queue]

    @property
    def full(self) -> bool:
        return len(self._queue) >= self.depth

    def submit(self, batch: SchedulerOutput) -> None:
        if self.full:
            raise RuntimeError(f"microbatch queue is full ({self.depth}); finish() one first")
        if self._worker is None:
            future: Future[list[int | None]] = Future()
            try:
                future.set_result(self.execute(batch.seqs, batch.num_new_tokens))
            except BaseException as exc:  # re-raised by finish(), like the threaded path
                future.set_exception(exc)
        else:
            future = self._worker.submit(self.execute, batch.seqs, batch.num_new_tokens)
        self._queue.append((batch, future))

    def finish(self) -> tuple[SchedulerOutput, list[int | None]]:
        """Wait for the oldest in-flight microbatch; returns it with its sampled tokens."""
        if not self._queue:
            raise RuntimeError("no microbatch in flight")
        batch, future = self._queue.popleft()
        try:
            return batch, future.result()
        except Exception as exc:
            raise ExecutionError(batch, exc) from exc

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
