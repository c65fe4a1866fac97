"""What the head of a stage group needs from a stage, wherever the stage runs."""

from __future__ import annotations

from typing import Any, Protocol

from bucketserve.runtime.worker.pipeline.stage_clock import StageSpan
from bucketserve.runtime.worker.pipeline.stage_spec import StageSpec
from bucketserve.runtime.worker.pipeline.stage_step import StageStep


class StageDeadError(RuntimeError):
    """A stage of the group is gone (its actor died): the whole group must be restarted."""


class Stage(Protocol):
    """One stage. `submit` queues a microbatch behind the ones before it and returns a
    handle at once; `prev` is the previous stage's handle for the same microbatch (None on
    the first stage), whose output becomes this stage's input without passing the head."""

    spec: StageSpec

    def submit(self, step: StageStep, prev: Any) -> Any: ...

    def wait(self, handle: Any) -> None: ...

    def done(self, handle: Any, timeout_s: float) -> bool: ...

    def result(self, handle: Any) -> Any: ...

    def warmup(self, shapes: list[tuple[int, int, int]]) -> None: ...

    def info(self) -> dict: ...

    def export_blocks(self, layer: int, block_ids: list[int]) -> Any: ...

    def import_blocks(self, layer: int, block_ids: list[int], data: Any) -> None: ...

    def clock(self, spans: bool, fresh: bool) -> tuple[float, int, list[StageSpan]]:
        """(busy s, microbatches, spans if asked); a remote stage may answer with its last
        report unless `fresh`."""
        ...

    def shutdown(self) -> None: ...
