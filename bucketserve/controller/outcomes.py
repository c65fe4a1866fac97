"""What dispatch returns to the Controller: one outcome per thing that happened to a batch
on its way, for the Controller to apply to its request table, the output streams and the
workers (a `Failure` goes to its fault policy). Torch-free.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass

from bucketserve.controller.request_state import RequestState
from bucketserve.controller.worker_handle import Failure, WorkerHandle
from bucketserve.messages import TokenDelta


@dataclass(frozen=True)
class Deliver:
    """A prefill's first token of `state`, for its stream."""

    state: RequestState
    delta: TokenDelta


@dataclass(frozen=True)
class Requeue:
    """`state` lost its worker or its admission: queue it for a re-prefill of everything it
    has so far, or end it if it may not be re-prefilled again."""

    state: RequestState
    why: str


@dataclass(frozen=True)
class FailRequest:
    """End `state` now with an error (a worker rejected it, or its prefill failed too often)."""

    state: RequestState
    error: str


@dataclass(frozen=True)
class AbortOnWorker:
    """Abort the request (only its sample `index`, if given) on the decode worker that has
    it: it was cancelled while it was being admitted, or a stop string ended it already."""

    decode: WorkerHandle
    request_id: str
    index: int | None = None


Outcome = Deliver | Requeue | FailRequest | AbortOnWorker | Failure
# one batch's way, from the dispatcher: its outcomes in the order they happen; the next
# step waits until the Controller has applied the one before
Flight = AsyncGenerator[Outcome, None]
