"""One prefill batch's way to its decode worker: reserve -> prefill -> admit -> release.

Each step returns an outcome (first tokens, an admission, a batch to put back, requests
to re-queue, worker failures to judge) that the Dispatcher turns into the Controller's
(`outcomes.py`), instead of calling up into either. Epochs guard every step: work started
in a worker life that has ended since belongs to nobody, whatever its reply says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from bucketserve.bucket_manager.prefill_batch import PrefillBatch
from bucketserve.controller.worker_handle import Failure, WorkerDiedError, WorkerHandle
from bucketserve.kv_transfer.lease import LeaseError
from bucketserve.messages import (
    AdmitResult,
    PrefillResult,
    PrefillTask,
    Reservation,
    ReservationError,
    WorkerRequest,
)
from bucketserve.prefill_worker.prefill_worker import PrefillCapacityError

logger = logging.getLogger(__name__)


@dataclass
class Prefilled:
    """The outcome of reserve + prefill. `result` is None when the batch never got its
    first tokens: then `put_back` says it goes back to the queue (`count`: as a failed
    try of its requests) and `poll` names a worker whose reported room was stale. The
    `failures` are calls to judge, in the order they happened."""

    result: PrefillResult | None = None
    put_back: bool = False
    count: bool = False
    poll: WorkerHandle | None = None
    failures: list[Failure] = field(default_factory=list)


@dataclass
class Admitted:
    """The outcome of admission. `ack` is None when nothing was admitted: then every
    request is re-queued with `why`. The `failures` are calls to judge, in order."""

    ack: AdmitResult | None = None
    why: str = ""
    failures: list[Failure] = field(default_factory=list)


class Handoff:
    """Moves one batch from `prefill` to `decode`. Creating it books the batch's blocks on
    both workers (a batch in flight at the prefill worker, blocks pending on each);
    `close()` gives back what is still booked."""

    def __init__(
        self,
        prefill: WorkerHandle,
        decode: WorkerHandle,
        need: list[tuple[str, int]],
        decode_need: list[tuple[str, int]],
        lease_ttl_s: float,
        fork_blocks: int = 0,
    ) -> None:
        """`need`: the blocks each request's prompt takes on the prefill worker;
        `decode_need`: those of the requests whose KV is shipped (once) to the decode worker,
        the others end at their first token (PDScheduler.decode_need); `fork_blocks`: what
        extra samples take on the decode side once admitted (PDScheduler.fork_blocks)."""
        self.prefill, self.decode = prefill, decode
        self.need = decode_need
        self.total = sum(n for _, n in need)
        self.decode_total = sum(n for _, n in decode_need) + fork_blocks
        self.lease_ttl_s = lease_ttl_s
        self.epochs = (prefill.epoch, decode.epoch)
        self.reservation: Reservation | None = None
        self.result: PrefillResult | None = None
        prefill.inflight += 1
        prefill.pending_blocks += self.total
        decode.pending_blocks += self.decode_total

    async def run_prefill(
        self, batch: PrefillBatch, requests: list[WorkerRequest], max_seq_len: int
    ) -> Prefilled:
        """Reserve the blocks on the decode worker, then prefill `batch` (whose `requests`
        carry their tokens so far) into them. A batch whose requests all end at their first
        token reserves nothing and ships no KV."""
        decode, prefill = self.decode, self.prefill
        if self.need:
            refused = await self._reserve(requests)
            if refused is not None:
                return refused
        reservation = self.reservation
        try:
            task = PrefillTask(
                batch_id=batch.batch_id,
                requests=requests,
                shape=batch.shape,
                graph_miss=batch.graph_miss,
                target=None if reservation is None else reservation.handle,
                max_seq_len=max_seq_len,
            )
            result = await prefill.call("run_batch", task)
        except Exception as exc:
            released = []
            if reservation is not None:
                released = await self._release(decode, reservation.lease_id, self.epochs[1])
            count = not isinstance(exc, (PrefillCapacityError, LeaseError))
            failures = [*released, Failure(prefill, exc, self.epochs[0])]
            return Prefilled(put_back=True, count=count, failures=failures)
        if prefill.epoch == self.epochs[0]:
            prefill.stats = result.stats
        self.result = result
        return Prefilled(result=result)

    async def _reserve(self, requests: list[WorkerRequest]) -> Prefilled | None:
        """Reserve the decode side's blocks (`self.reservation`); the outcome if refused.
        Each request's tokens go along, so the blocks the decode worker's prefix cache
        holds already are reserved as they are and not sent."""
        decode = self.decode
        by_id = {r.request_id: r for r in requests}
        token_ids = [
            [*by_id[rid].prompt_token_ids, *by_id[rid].output_token_ids] for rid, _ in self.need
        ]
        roots = [by_id[rid].tenant.cache_root for rid, _ in self.need]
        try:
            reservation = await decode.call(
                "reserve", self.need, self.lease_ttl_s, token_ids, roots
            )
        except ReservationError as exc:  # its free count moved on since our last report
            logger.info("reservation on %s failed: %s", decode.name, exc)
            return Prefilled(put_back=True, poll=decode)
        except Exception as exc:
            return Prefilled(put_back=True, failures=[Failure(decode, exc, self.epochs[1])])
        finally:
            if decode.epoch == self.epochs[1]:
                decode.pending_blocks -= self.decode_total
                self.decode_total = 0
        if decode.epoch == self.epochs[1]:
            decode.stats = reservation.stats
        self.reservation = reservation
        return None

    async def admit(self, requests: list[WorkerRequest]) -> Admitted:
        """Admit `requests` (the batch less those cancelled meanwhile) on the decode worker,
        then release the prefill worker's lease (the handoff is acknowledged)."""
        assert self.reservation is not None and self.result is not None
        decode, epoch = self.decode, self.epochs[1]
        try:
            outcome = await self._admit(requests)
        finally:
            release = await self._release(self.prefill, self.result.lease_id, self.epochs[0])
        outcome.failures += release
        if outcome.ack is not None and decode.epoch == epoch:
            decode.stats = outcome.ack.stats
        return outcome

    async def _admit(self, requests: list[WorkerRequest]) -> Admitted:
        decode, epoch = self.decode, self.epochs[1]
        try:
            if decode.epoch != epoch:
                raise WorkerDiedError(f"{decode.name} restarted since the reservation")
            ack = await decode.call(
                "admit_prefilled", self.reservation.lease_id, requests, self.result.payload
            )
        except Exception as exc:
            why = f"admission on {decode.name} failed: {exc}"
            return Admitted(why=why, failures=[Failure(decode, exc, epoch)])
        if decode.epoch != epoch:  # admitted by a life of the worker that has ended since
            return Admitted(why=f"{decode.name} died after admitting it")
        return Admitted(ack=ack)

    def close(self) -> None:
        """The batch is no longer in flight at the prefill worker (unless it died since), nor
        booked on the decode worker."""
        if self.prefill.epoch == self.epochs[0]:
            self.prefill.inflight -= 1
            self.prefill.pending_blocks -= self.total
        if self.decode.epoch == self.epochs[1]:  # booked but never reserved
            self.decode.pending_blocks -= self.decode_total
            self.decode_total = 0

    @staticmethod
    async def _release(handle: WorkerHandle, lease_id: str, epoch: int) -> list[Failure]:
        if handle.epoch != epoch:
            return []
        try:
            await handle.call("release", lease_id)
        except Exception as exc:  # a dead worker's pool is gone with it
            return [Failure(handle, exc, epoch)]
        return []
