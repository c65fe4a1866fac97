"""A stage on a thread of this process, with its own intra-op thread count."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, wait
from typing import Any

from bucketserve.runtime.worker.pipeline.stage_clock import StageSpan
from bucketserve.runtime.worker.pipeline.stage_runner import StageRunner
from bucketserve.runtime.worker.pipeline.stage_step import StageStep

_STOP = object()


class LocalStage:
    """Runs its StageRunner's microbatches in submission order on one thread. Torch ops
    release the GIL, so the stages of one process compute at the same time on different
    cores; each thread sets its own OpenMP team size (`torch_threads`)."""

    def __init__(self, runner: StageRunner, torch_threads: int | None = None) -> None:
        self.runner = runner
        self.spec = runner.spec
        self.torch_threads = torch_threads
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(
            target=self._loop, name=f"stage-{self.spec.index}", daemon=True
        )
        self._thread.start()

    def submit(self, step: StageStep, prev: Future | None) -> Future:
        future: Future = Future()
        self._queue.put((step, prev, future))
        return future

    def wait(self, handle: Future) -> None:
        handle.exception()

    def done(self, handle: Future, timeout_s: float) -> bool:
        return not wait([handle], timeout_s).not_done

    def result(self, handle: Future) -> Any:
        return handle.result()

    def warmup(self, shapes: list[tuple[int, int, int]]) -> None:
        self._call(lambda: self.runner.warmup(shapes))

    def info(self) -> dict:
        return self.runner.info()

    def export_blocks(self, layer: int, block_ids: list[int]) -> Any:
        return self.runner.export_blocks(layer, block_ids)

    def import_blocks(self, layer: int, block_ids: list[int], data: Any) -> None:
        self.runner.import_blocks(layer, block_ids, data)

    def clock(self, spans: bool, fresh: bool) -> tuple[float, int, list[StageSpan]]:
        return self.runner.clock.snapshot(spans)

    def shutdown(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)
        stop_ranks = getattr(self.runner, "shutdown", None)  # a tensor-parallel stage's
        if stop_ranks is not None:
            stop_ranks()

    def _call(self, fn) -> Any:
        """Run `fn` on the stage's thread (its thread count) after the queued work."""
        future: Future = Future()
        self._queue.put((fn, None, future))
        return future.result()

    def _loop(self) -> None:
        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            work, prev, future = item
            try:
                if callable(work):
                    future.set_result(work())
                    continue
                hidden = None if prev is None else prev.result()
                future.set_result(self.runner.run(work, hidden))
            except BaseException as exc:
                future.set_exception(exc)
