"""A request's own priority ranks it only among its tenant's requests, all the way down: the
bucket manager picks the tenant first, the controller hands the decode engine the (tenant,
request) pair, and the engine's priority policy admits and preempts by that pair. A `batch`
tenant's request sending priority -1000000 never gets ahead of an interactive tenant's."""

from __future__ import annotations

from bucketserve.bucket_manager import BucketRequest, TenantConfig
from bucketserve.controller.request_state import RequestState
from bucketserve.controller.request_stream import RequestStream
from bucketserve.messages import ServeRequest
from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from bucketserve.runtime.core.sequence import Sequence, SequenceStatus
from tests.bucket_manager.helpers import ids, make_manager

INTERACTIVE = TenantConfig(name="interactive", tenant_class="online", policy="fcfs", priority=0)
BATCH = TenantConfig(name="batch", tenant_class="offline", policy="sjf", priority=1)
TENANTS = {t.name: t for t in (INTERACTIVE, BATCH)}
PUSHY = -1_000_000


async def _never(request_id: str) -> bool:
    return False


def state(request_id: str, tenant: str, priority: int, arrival: float) -> RequestState:
    request = ServeRequest(
        request_id, [10, 11, 12, 13], SamplingParams(temperature=0, max_tokens=10),
        tenant=tenant, priority=priority, arrival_time=arrival,
    )
    return RequestState(request, RequestStream(request_id, _never))


def engine_sequence(s: RequestState) -> Sequence:
    """The sequence a decode worker's engine makes of the controller's WorkerRequest."""
    work = s.worker_request(TENANTS[s.request.tenant])
    return Sequence(
        list(work.prompt_token_ids), work.sampling_params, seq_id=work.request_id,
        arrival_time=s.request.arrival_time, priority=work.priority,
    )


def test_the_bucket_manager_serves_the_interactive_tenant_first() -> None:
    manager = make_manager(INTERACTIVE, BATCH)
    manager.add(BucketRequest("batch-pushy", 4, tenant="batch", arrival_time=0.0,
                              priority=PUSHY))
    manager.add(BucketRequest("chat", 4, tenant="interactive", arrival_time=1.0,
                              priority=5))
    manager.add(BucketRequest("batch-calm", 4, tenant="batch", arrival_time=0.5))
    first = manager.next_batch(free_blocks=1000, block_size=16, now=2.0)
    second = manager.next_batch(free_blocks=1000, block_size=16, now=2.0)
    assert ids(first) == ["chat"]
    assert ids(second) == ["batch-pushy", "batch-calm"]  # its priority ranks it in batch


def test_the_worker_request_carries_the_tenant_priority_before_the_requests() -> None:
    pushy = state("batch-pushy", "batch", PUSHY, 0.0)
    assert pushy.worker_request(BATCH).priority == (1, PUSHY)
    assert state("chat", "interactive", 5, 1.0).worker_request(INTERACTIVE).priority == (0, 5)


def test_the_engine_admits_and_preempts_by_tenant_first() -> None:
    """Room for two sequences' first blocks only: the interactive request is admitted first
    and, when both need another block, the batch tenant's pushy request is preempted."""
    engine = Scheduler(
        SchedulerConfig(max_num_seqs=2, scheduling_policy="priority", watermark=0.0),
        BlockManager(4, 4), 256, eos_token_ids=[2],
    )
    for s in (
        state("batch-pushy", "batch", PUSHY, 0.0),
        state("chat", "interactive", 5, 1.0),
        state("batch-calm", "batch", 0, 0.5),
    ):
        engine.add(engine_sequence(s))
    assert [q.seq_id for q in engine.waiting] == ["chat", "batch-pushy", "batch-calm"]

    def step() -> list[str]:
        out = engine.schedule()
        engine.update(out, [5 if n == q.num_uncomputed_tokens else None
                            for q, n in zip(out.seqs, out.num_new_tokens, strict=True)])
        return [q.seq_id for q in out.seqs]

    assert step() == ["chat", "batch-pushy"]  # both prompts fill a block each
    for _ in range(4):
        assert step() == ["chat", "batch-pushy"]
    assert step() == ["chat"]  # both need a second block and one is free: batch's goes
    assert engine.get("batch-pushy").status == SequenceStatus.WAITING
    assert engine.get("chat").status == SequenceStatus.RUNNING
    assert engine.num_preemptions == 1
