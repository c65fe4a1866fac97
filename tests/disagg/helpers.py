"""What the disaggregated tests share: a mixed-length greedy workload, its in-process reference,
and a driver that pushes it through a Controller and checks the pools drained."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

from bucketserve.controller.controller import Controller
from bucketserve.controller.request_state import RequestState
from bucketserve.controller.request_stream import RequestStream
from bucketserve.controller.worker_handle import WorkerHandle
from bucketserve.messages import ServeRequest, StreamDelta, WorkerStats
from bucketserve.runtime.core.sampling_params import SamplingParams
from tests.worker_threads import worker_threads

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 256
NUM_REQUESTS = 16


def mixed_workload(n: int = NUM_REQUESTS, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """`n` prompts of 3..60 random tokens, each with its own greedy max_tokens (6..24)."""
    rng = random.Random(seed)
    work = []
    for i in range(n):
        length = 3 + (i * 37) % 58  # spread over every request bucket, not sorted
        prompt = [rng.randrange(3, 49152) for _ in range(length)]
        work.append((prompt, SamplingParams(temperature=0, max_tokens=6 + (i * 7) % 19)))
    return work


def reference_outputs(model_dir: Path, work: list[tuple[list[int], SamplingParams]]) -> list:
    """Token ids from the in-process engine (bucketserve.runtime.engine.llm.LLM), the reference."""
    from bucketserve.runtime.engine.llm import LLM

    llm = LLM(str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS)
    outs = llm.generate([p for p, _ in work], [s for _, s in work], use_tqdm=False)
    return [o.token_ids for o in outs]


def controller_config(model_dir: Path, **options: Any) -> Any:
    """The tiny model's service; each Ray actor's intra-op pool is this test process's share
    of the cores (`worker_threads`) unless a placement says."""
    from bucketserve.controller.config import ControllerConfig
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    runner = ModelRunnerConfig(
        model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS
    )
    # the handoff is what these tests are about: every prompt goes to a prefill worker
    options = {
        "stats_interval_s": 0.2, "topology": "disaggregated", "remote_prefill": "always", **options
    }
    for role in ("prefill", "decode"):  # a role's keys as a mapping
        options[role] = {"torch_threads": worker_threads(), **options.get(role, {})}
    return ControllerConfig(runner=runner, **options)


async def collect(controller: Any, request: ServeRequest) -> list[StreamDelta]:
    return await controller.submit(request).collect()


async def generate(
    controller: Any, work: list[tuple[list[int], SamplingParams]], tag: str
) -> list[list[StreamDelta]]:
    """Every request of `work` submitted at once; each one's deltas, in order."""
    requests = [
        ServeRequest(f"{tag}-{i}", list(prompt), params) for i, (prompt, params) in enumerate(work)
    ]
    return list(await asyncio.gather(*(collect(controller, r) for r in requests)))


def tokens(streams: list[list[StreamDelta]]) -> list[list[int]]:
    """The generated ids of each stream, after checking it ends in exactly one final delta."""
    out = []
    for deltas in streams:
        assert [d.finished for d in deltas].count(True) == 1 and deltas[-1].finished, deltas
        assert deltas[-1].finish_reason in ("stop", "length"), deltas[-1]
        out.append([t for d in deltas for t in d.token_ids])
    return out


def assert_drained(stats: Any) -> None:
    """Every block free on every worker, no lease open, no request left."""
    pools = {w.name: (w.num_free_blocks, w.num_total_blocks) for w in stats.workers}
    assert all(free == total > 0 for free, total in pools.values()), pools
    assert stats.leases_open == 0 and stats.running == 0 and stats.waiting == 0, stats


async def serve_and_drain(controller: Any, work: list, tag: str) -> tuple[list[list[int]], Any]:
    """The token ids a started controller gives `work`, and its stats once drained (every
    block and lease back); the controller is shut down either way."""
    try:
        outputs = tokens(await generate(controller, work, tag))
        stats = await controller.drain(30)
    finally:
        await controller.shutdown()
    assert_drained(stats)
    return outputs, stats


def small_batches(max_num_seqs: int = 4) -> Any:
    """Default buckets for the tiny model with prefill batches of at most `max_num_seqs`, so
    the 16 requests spread over several batches (and workers)."""
    from bucketserve.controller.service_limits import ServiceLimits

    buckets = ServiceLimits.default_buckets(512, BLOCK_SIZE, 64)
    return dataclasses.replace(
        buckets, batching=buckets.batching.model_copy(update={"max_num_seqs": max_num_seqs})
    )


async def generate_signalling(controller: Any, work: list, first: asyncio.Event) -> list:
    """Like `generate`, setting `first` once request 0 has streamed 4 tokens."""

    async def watched(request: ServeRequest) -> list:
        out, seen = [], 0
        async for delta in controller.submit(request):
            out.append(delta)
            seen += len(delta.token_ids)
            if seen >= 4:
                first.set()
        return out

    requests = [ServeRequest(f"kill-{i}", list(p), s) for i, (p, s) in enumerate(work)]
    return list(
        await asyncio.gather(watched(requests[0]), *(collect(controller, r) for r in requests[1:]))
    )


async def generate_killing(controller: Any, work: list, role: str) -> list:
    """`work`'s outputs, with worker `{role}-0` killed mid-request: a prefill worker while it
    holds a batch, a decode worker once request 0 has streamed tokens."""
    first = asyncio.Event()
    run = asyncio.ensure_future(generate_signalling(controller, work, first))
    if role == "prefill":
        handle = controller.pool.by_name("prefill-0")
        for _ in range(10_000):  # until it holds a batch
            if handle.inflight:
                break
            await asyncio.sleep(0.001)
    else:
        await first.wait()
    await controller.kill_worker(f"{role}-0")
    return await run


class IdleHandle(WorkerHandle):
    """A live worker that reports stats and is never called (the dispatcher's choices are
    what a test looks at)."""

    def __init__(self, name: str, free: int, role: str = "decode") -> None:
        super().__init__(name, role)
        self.alive = True
        self.stats = WorkerStats(name, role, "node", free, NUM_KV_BLOCKS)

    async def _call(self, method: str, *args: Any) -> Any:
        raise AssertionError(f"{self.name} was called: {method}")

    async def start(self) -> None: ...

    async def kill(self) -> None: ...

    async def stop(self) -> None: ...


def queue(controller: Controller, rid: str, tokens: list[int]) -> RequestState:
    params = SamplingParams(temperature=0, max_tokens=4)
    state = RequestState(ServeRequest(rid, tokens, params), RequestStream(rid, _no))
    controller._requests[rid] = state
    controller.dispatcher.queue(state)
    return state


async def _no(request_id: str) -> bool:
    return False


def dispatch(controller: Controller) -> None:
    for flight in controller.dispatcher.dispatch():
        asyncio.run(flight.aclose())  # never flown: the placement is what is looked at
