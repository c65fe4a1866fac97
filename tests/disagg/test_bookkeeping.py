"""Leases, reservations and the choice of decode worker: the torch-free bookkeeping."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from bucketserve.controller.pd_scheduler import PDScheduler
from bucketserve.controller.worker_handle import LocalWorkerHandle
from bucketserve.kv_transfer.lease import LeaseError, LeaseState, LeaseTable
from bucketserve.messages import WorkerStats
from bucketserve.runtime.core.block_manager import BlockManager

TORCH_FREE = (
    "bucketserve.kv_transfer.lease",
    "bucketserve.kv_transfer.kv_format",
    "bucketserve.kv_transfer.transport",
    "bucketserve.messages",
    "bucketserve.controller.request_state",
    "bucketserve.controller.pd_scheduler",
)


def test_worker_messages_carry_token_ids_and_no_text() -> None:
    """Text and stop strings are the controller's output processor's alone."""
    from bucketserve import messages

    sent_by_workers = (
        messages.TokenDelta, messages.StepOutput, messages.PrefillResult, messages.Reservation,
        messages.AdmitResult, messages.WorkerStats,
    )
    for cls in sent_by_workers:
        names = {f.name for f in dataclasses.fields(cls)}
        assert not any("text" in name for name in names), (cls.__name__, names)
    assert {f.name for f in dataclasses.fields(messages.TokenDelta)} == {
        "request_id", "token_offset", "token_ids", "finished", "finish_reason", "error",
        "logprobs", "prompt_logprobs",  # numbers that ride with the token ids, never text
        "index",  # the sample of an n > 1 request
        "num_cached_tokens",  # with the first token: how many prompt tokens were cached
    }


def test_the_admitted_request_is_one_object_from_the_controller_to_the_workers() -> None:
    """Nothing after admission copies a ServeRequest's fields: the controller's state holds
    it, the bucket manager's entry carries that state, a WorkerRequest carries it."""
    from bucketserve.bucket_manager.config import TenantConfig
    from bucketserve.controller.request_state import RequestState
    from bucketserve.controller.request_stream import RequestStream
    from bucketserve.messages import ServeRequest
    from bucketserve.runtime.core.sampling_params import SamplingParams

    async def abort(request_id: str) -> bool:
        return False

    request = ServeRequest("r", [1, 2, 3], SamplingParams(max_tokens=4), tenant="t", priority=-1)
    state = RequestState(request, RequestStream("r", abort))
    state.output_token_ids.extend([7])
    sent = state.worker_request()
    assert sent.request is request and sent.prompt_token_ids is request.prompt_token_ids
    assert (sent.request_id, sent.sampling_params) == ("r", request.sampling_params)
    assert sent.output_token_ids == [7] and sent.num_tokens == 4
    assert sent.priority == (0, -1)
    assert state.worker_request(TenantConfig(name="t", priority=2)).priority == (2, -1)
    assert sent.ttft_left_s is None  # it has streamed a token: its TTFT is behind it
    state.output_token_ids.extend([8])  # a snapshot: later tokens are the next one's
    assert sent.output_token_ids == [7]
    arrival = time.monotonic() - 1.0
    fresh = RequestState(
        ServeRequest("f", [1], SamplingParams(), arrival_time=arrival), RequestStream("f", abort)
    )

    def left_of(tenant: TenantConfig) -> tuple[float, float, float]:
        """(least, ttft_left_s, most): the target less the time waited, bounded by clock
        readings around the call however long it took."""
        before = time.monotonic()
        left = fresh.worker_request(tenant).ttft_left_s
        return -(time.monotonic() - arrival), left, -(before - arrival)

    least, left, most = left_of(TenantConfig(name="t", ttft_slo_s=4.0))
    assert 4.0 + least <= left <= 4.0 + most  # its tenant's 4 s target, less the time waited
    fresh.request.slo_ttft_s = 10.0  # the request's own target wins
    least, left, most = left_of(TenantConfig(name="t", ttft_slo_s=4.0))
    assert 10.0 + least <= left <= 10.0 + most
    least, left, most = left_of(TenantConfig(name="t"))
    assert 10.0 + least <= left <= 10.0 + most
    fresh.request.slo_ttft_s = None
    assert fresh.worker_request(TenantConfig(name="t")).ttft_left_s is None  # no target at all
    assert fresh.worker_request(TenantConfig(name="t", tpot_slo_s=0.2)).tpot_s == 0.2
    fresh.request.slo_tpot_s = 0.1  # the request's own TPOT target wins, too
    assert fresh.worker_request(TenantConfig(name="t", tpot_slo_s=0.2)).tpot_s == 0.1
    assert state.worker_request().tpot_s is None
    assert sent.output_token_ids == [7]
    entry = state.bucket_request(max_tokens=3)
    assert entry.item is state
    assert (entry.request_id, entry.prompt_len, entry.tenant) == ("r", 5, "t")


def test_bookkeeping_modules_import_without_torch() -> None:
    code = f"import sys; import {', '.join(TORCH_FREE)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class Pool:
    """A decode pool's bookkeeping as DecodeWorker keeps it: reserved blocks under leases."""

    def __init__(self, num_blocks: int = 16) -> None:
        self.blocks = BlockManager(num_blocks, 4)
        self.freed: list[str] = []
        self.leases = LeaseTable("decode-0.boot", self._free)

    def _free(self, lease) -> None:
        self.freed.append(lease.lease_id)
        self.blocks.release(lease.flat_block_ids)

    def reserve(self, counts: list[int], ttl: float, now: float):
        flat = self.blocks.reserve(sum(counts))
        split, at = [], 0
        for n in counts:
            split.append(flat[at : at + n])
            at += n
        return self.leases.open([f"r{i}" for i in range(len(counts))], split, ttl, now=now)


def test_an_expired_reservation_gives_every_block_back_once() -> None:
    pool = Pool()
    lease = pool.reserve([3, 2], ttl=1.0, now=100.0)
    assert lease.lease_id == "decode-0.boot-0" and lease.num_blocks == 5
    assert pool.blocks.num_free_blocks == 11 and pool.blocks.num_reserved_blocks == 5
    assert pool.leases.next_deadline() == 101.0
    assert pool.leases.expire(now=100.9) == []
    assert [x.lease_id for x in pool.leases.expire(now=101.0)] == [lease.lease_id]
    assert pool.blocks.num_free_blocks == 16 and pool.blocks.num_reserved_blocks == 0
    assert lease.state == LeaseState.EXPIRED and pool.leases.counts.expired == 1
    with pytest.raises(LeaseError, match="has already expired"):
        pool.leases.release(lease.lease_id)
    with pytest.raises(LeaseError, match="has already expired"):
        pool.leases.close(lease.lease_id)
    assert pool.freed == [lease.lease_id] and pool.blocks.num_free_blocks == 16


def test_a_lease_being_written_does_not_expire_until_the_writer_is_done() -> None:
    pool = Pool()
    lease = pool.reserve([4], ttl=1.0, now=0.0)
    pool.leases.begin_receive(lease.lease_id)
    assert pool.leases.expire(now=50.0) == [] and pool.blocks.num_free_blocks == 12
    pool.leases.end_receive(lease.lease_id)
    assert pool.leases.expire(now=50.0) == [lease]
    assert pool.blocks.num_free_blocks == 16


def test_an_acknowledged_lease_keeps_its_blocks_and_a_released_one_frees_them() -> None:
    pool = Pool()
    kept = pool.reserve([2], ttl=5.0, now=0.0)
    given_back = pool.reserve([3], ttl=5.0, now=0.0)
    pool.leases.close(kept.lease_id)  # the blocks went on to their sequence
    pool.leases.release(given_back.lease_id)
    assert pool.freed == [given_back.lease_id]
    assert pool.blocks.num_free_blocks == 14 and len(pool.leases) == 0
    assert pool.leases.expire(now=1e9) == []
    counts = pool.leases.counts
    assert (counts.opened, counts.closed, counts.released, counts.expired) == (2, 1, 1, 0)
    with pytest.raises(LeaseError, match="already been acknowledged"):
        pool.leases.release(kept.lease_id)
    with pytest.raises(LeaseError, match=r"unknown lease 'decode-9\.x-0'"):
        pool.leases.get("decode-9.x-0")


def test_release_all_frees_every_live_lease() -> None:
    pool = Pool()
    for _ in range(3):
        pool.reserve([2], ttl=5.0, now=0.0)
    assert len(pool.leases.release_all()) == 3
    assert pool.blocks.num_free_blocks == 16 and len(pool.leases) == 0


@pytest.mark.parametrize(
    ("ttl", "block_ids", "match"),
    [(0, [[1]], "ttl_s must be a positive"), (True, [[1]], "ttl_s"), (1.0, [], "one block list")],
)
def test_a_bad_lease_is_refused_and_nothing_is_opened(ttl, block_ids, match) -> None:
    table = LeaseTable("p", lambda lease: None)
    with pytest.raises(ValueError, match=match):
        table.open(["r0"], block_ids, ttl)
    assert len(table) == 0 and table.counts.opened == 0


def decode_handle(name: str, free: int, running: int, pending: int = 0) -> LocalWorkerHandle:
    handle = LocalWorkerHandle(name, "decode", factory=lambda: None, threads=1)
    handle.stats = WorkerStats(name, "decode", "n", free, 64, running=running)
    handle.pending_blocks = pending
    return handle


def test_the_reservation_goes_to_the_decode_worker_with_most_room_then_least_load() -> None:
    def pick(handles: list) -> str:
        pd = PDScheduler(len(handles), 4)
        for i, handle in enumerate(handles):
            pd.update(i, handle.free_blocks, handle.load)
        return handles[pd.pick_decode()].name

    handles = [
        decode_handle("busy", 40, running=9),
        decode_handle("idle", 40, running=1),
        decode_handle("small", 30, running=0),
        decode_handle("promised", 60, running=0, pending=25),  # blocks being reserved
    ]
    assert pick(handles) == "idle"
    handles[1].stats.num_free_blocks = 39
    assert pick(handles) == "busy"
    assert handles[3].free_blocks == 35


def test_the_reservation_counts_shared_prompt_blocks_once() -> None:
    """n > 1 samples ship the prompt's KV once; each takes a tail block of its own after."""
    from types import SimpleNamespace

    from bucketserve.bucket_manager.request import BucketRequest

    batch = SimpleNamespace(requests=(
        BucketRequest("one", prompt_len=10, max_tokens=8),
        BucketRequest("fan", prompt_len=10, max_tokens=8, samples=3),
    ))
    pd = PDScheduler(1, 4)
    assert pd.need(batch) == [("one", 3), ("fan", 3)]  # not 3 x 3 for the fan
    assert pd.fork_blocks(batch) == 2


def test_only_requests_that_go_on_to_decode_reserve_decode_blocks() -> None:
    """One token left (max_tokens, or the room to the model's length) and one sample: the
    prefill's token ends it, so the decode side holds nothing for it."""
    from types import SimpleNamespace

    from bucketserve.bucket_manager.request import BucketRequest

    batch = SimpleNamespace(requests=(
        BucketRequest("last", prompt_len=10, max_tokens=1),
        BucketRequest("more", prompt_len=10, max_tokens=2),
        BucketRequest("fan", prompt_len=5, max_tokens=1, samples=2),
        BucketRequest("open", prompt_len=5),
    ))
    pd = PDScheduler(1, 4)
    assert pd.need(batch) == [("last", 3), ("more", 3), ("fan", 2), ("open", 2)]
    assert pd.decode_need(batch) == [("more", 3), ("fan", 2), ("open", 2)]
