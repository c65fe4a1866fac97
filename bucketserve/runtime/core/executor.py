"""The microbatch queue between the engine loop and the model runner."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from bucketserve.runtime.core.scheduler_output import SchedulerOutput
from bucketserve.runtime.core.sequence import Sequence

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
    (the pipeline-parallel RFC's two-stage loop). Subclasses start a batch
    elsewhere (`_start`, `_result`); errors in `passthrough` are not a failed batch.
    """

    passthrough: tuple[type[BaseException], ...] = ()

    def __init__(self, execute: ExecuteFn | None, depth: int = 1) -> None:
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"pipeline depth must be a positive integer, got {depth!r}")
        self.execute = execute
        self.depth = depth
        self._queue: deque[tuple[SchedulerOutput, Any]] = deque()
        self._worker: ThreadPoolExecutor | None = None
        self.peak_in_flight = 0

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
        self._queue.append((batch, self._start(batch)))
        self.peak_in_flight = max(self.peak_in_flight, len(self._queue))

    def finish(self) -> tuple[SchedulerOutput, list[int | None]]:
        """Wait for the oldest in-flight microbatch; returns it with its sampled tokens."""
        if not self._queue:
            raise RuntimeError("no microbatch in flight")
        batch, handle = self._queue.popleft()
        try:
            return batch, self._result(handle)
        except self.passthrough:
            raise
        except Exception as exc:
            raise ExecutionError(batch, exc) from exc

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)

    def _start(self, batch: SchedulerOutput) -> Future[list[int | None]]:
        assert self.execute is not None
        if self.depth == 1:
            future: Future[list[int | None]] = Future()
            try:
                future.set_result(self.execute(batch.seqs, batch.num_new_tokens))
            except BaseException as exc:  # re-raised by finish(), like the threaded path
                future.set_exception(exc)
            return future
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, "executor")
        return self._worker.submit(self.execute, batch.seqs, batch.num_new_tokens)

    def _result(self, handle: Future[list[int | None]]) -> list[int | None]:
        return handle.result()
