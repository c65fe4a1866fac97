"""The dispatcher returns what happened to a batch as outcomes; the controller applies them
(its request table, the streams, the fault policy). No worker runs here."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from bucketserve.controller.controller import Controller
from bucketserve.controller.outcomes import FailRequest, Requeue
from bucketserve.controller.request_state import RequestState
from bucketserve.controller.request_stream import RequestStream
from bucketserve.controller.worker_handle import Failure, WorkerDiedError, WorkerHandle
from bucketserve.messages import ServeRequest, WorkerStats
from bucketserve.runtime.core.sampling_params import SamplingParams
from tests.disagg.helpers import controller_config


class DeadHandle(WorkerHandle):
    """A decode worker that dies on every call."""

    def __init__(self) -> None:
        super().__init__("decode-0", "decode")
        self.alive = True
        self.stats = WorkerStats("decode-0", "decode", "node", 256, 256)

    async def _call(self, method: str, *args: Any) -> Any:
        raise WorkerDiedError(f"{self.name} died during {method}")

    async def start(self) -> None: ...

    async def kill(self) -> None: ...

    async def stop(self) -> None: ...


def controller(model_dir: Path) -> Controller:
    return Controller(controller_config(model_dir, mode="local", topology="colocated"))


def state(request_id: str, controller: Controller) -> RequestState:
    params = SamplingParams(temperature=0, max_tokens=4)
    s = RequestState(ServeRequest(request_id, [5, 6, 7], params), RequestStream(request_id, _no))
    controller._requests[request_id] = s
    controller.outputs.add(request_id, s.request.prompt_token_ids, params)
    return s


async def _no(request_id: str) -> bool:
    return False


def test_a_failed_colocated_call_returns_requeues_then_the_failure(tiny_model_dir: Path) -> None:
    c = controller(tiny_model_dir)
    states = [state(f"r{i}", c) for i in range(2)]
    decode = DeadHandle()

    async def fly() -> list:
        return [o async for o in c.dispatcher._admit_prompts(decode, states, 3)]

    outcomes = asyncio.run(fly())
    assert [type(o) for o in outcomes] == [Requeue, Requeue, Failure]
    assert [o.state for o in outcomes[:2]] == states
    assert "decode-0 failed" in outcomes[0].why
    assert (outcomes[2].handle, outcomes[2].epoch) == (decode, 0)
    assert isinstance(outcomes[2].error, WorkerDiedError)
    assert decode.pending_blocks == 0  # its booking ended with the call


def test_the_controller_requeues_until_max_requeues_then_ends_the_request(
    tiny_model_dir: Path,
) -> None:
    c = controller(tiny_model_dir)
    again, spent = state("again", c), state("spent", c)
    spent.requeues = c.config.max_requeues

    async def apply() -> None:
        await c._apply(Requeue(again, "decode-0 died"))
        await c._apply(Requeue(spent, "decode-0 died"))

    asyncio.run(apply())
    assert again.phase == "queued" and "again" in c.buckets and again.requeues == 1
    assert spent.done and "spent" not in c.buckets
    final = spent.stream._queue.get_nowait()
    assert final.finished and final.finish_reason == "error"
    assert final.error == f"gave up after {c.config.max_requeues} re-prefills: decode-0 died"
    assert c.stats().requests_requeued == 2


def test_a_batch_put_back_keeps_its_place_and_ends_requests_out_of_tries(
    tiny_model_dir: Path,
) -> None:
    c = controller(tiny_model_dir)
    d = c.dispatcher
    kept, spent = state("kept", c), state("spent", c)
    for s in (kept, spent):
        d.queue(s)
    batch = d.buckets.next_batch(256, c.block_size, time.monotonic())
    assert batch is not None and len(batch) == 2
    d._take(batch, DeadHandle(), "prefill", "remote")
    spent.requeues = c.config.max_requeues
    outcomes = d.put_back(batch, count=True)
    assert outcomes == [FailRequest(spent, "its prefill failed too often")]
    assert kept.phase == "queued" and "kept" in c.buckets and "spent" not in c.buckets
    assert spent.phase == "prefill"  # until the controller ends it
