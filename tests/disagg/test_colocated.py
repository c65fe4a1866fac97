"""The colocated topology: no prefill workers; each decode worker's engine prefills its batches
within its decode steps (chunked under the token budget), no KV moves."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bucketserve.controller.controller import Controller
from tests.disagg.helpers import (
    assert_drained,
    controller_config,
    generate_signalling,
    serve_and_drain,
    small_batches,
    tokens,
)


async def started(model_dir: Path, **options: Any) -> Controller:
    config = controller_config(model_dir, mode="local", topology="colocated", **options)
    controller = Controller(config)
    await controller.start()
    return controller


@pytest.mark.parametrize("num_decode", [1, 2])
def test_colocated_matches_the_in_process_engine(
    tiny_model_dir: Path, work: list, reference: list, num_decode: int
) -> None:
    async def main() -> None:
        controller = await started(
            tiny_model_dir, decode={"num_workers": num_decode}, prefill={"num_workers": 3}
        )
        assert [h.role for h in controller.pool.handles] == ["decode"] * num_decode
        outputs, stats = await serve_and_drain(controller, work, "colocated")
        assert outputs == reference
        assert stats.transfers == 0 and stats.kv_bytes_moved == 0
        assert stats.requests_requeued == 0
        assert sum(stats.finish_reasons.values()) == len(work)

    asyncio.run(main())


def test_colocated_chunked_prefill_matches_unchunked(
    tiny_model_dir: Path, long_work: list, long_reference: list
) -> None:
    """A 16-token step budget splits every long prompt into chunks, beside decode steps."""
    chunked = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True}

    async def main() -> None:
        controller = await started(tiny_model_dir, decode=chunked)
        assert max(len(p) for p, _ in long_work) > 16
        outputs, _ = await serve_and_drain(controller, long_work, "chunked")
        assert outputs == long_reference

    asyncio.run(main())


def test_a_colocated_worker_killed_mid_request_loses_nothing(
    tiny_model_dir: Path, long_work: list, long_reference: list
) -> None:
    async def main() -> None:
        controller = await started(tiny_model_dir, buckets=small_batches())
        try:
            first = asyncio.Event()
            run = asyncio.ensure_future(generate_signalling(controller, long_work, first))
            await first.wait()
            await controller.kill_worker("decode-0")
            assert tokens(await run) == long_reference
            stats = await controller.drain(30)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        assert stats.worker("decode-0").restarts == 1 and stats.requests_requeued >= 1

    asyncio.run(main())


def test_a_burst_that_fits_the_pool_waits_in_no_queue(tiny_model_dir: Path, work: list) -> None:
    """Every request of a burst that fits the decode pool leaves the controller's queue in
    the first dispatch round: queue depth 0 while free blocks remain."""

    async def main() -> None:
        config = controller_config(tiny_model_dir, mode="local", topology="colocated")
        controller = Controller(config.model_copy(update={"buckets": small_batches(64)}))
        await controller.start()
        try:
            streams = [
                controller.submit(_request(f"burst-{i}", p, s)) for i, (p, s) in enumerate(work)
            ]
            await asyncio.sleep(0)  # one dispatcher round
            for _ in range(200):
                if not len(controller.buckets):
                    break
                await asyncio.sleep(0.005)
            assert len(controller.buckets) == 0
            assert controller.pool.role("decode")[0].free_blocks > 0
            await asyncio.gather(*(s.collect() for s in streams))
            stats = await controller.drain(30)
        finally:
            await controller.shutdown()
        assert_drained(stats)

    asyncio.run(main())


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_higher_priority_tenant_overtakes_the_engine_queue(
    tiny_model_dir: Path, policy: str
) -> None:
    """A batch tenant's requests fill the colocated engine's queue (one runs at a time);
    chat requests (a tenant of higher priority) that arrive then run next under the
    priority policy, and after every batch request under FCFS."""
    from bucketserve.bucket_manager.config import TenantConfig
    from bucketserve.deploy.serve_config import with_tenants
    from bucketserve.messages import ServeRequest
    from bucketserve.runtime.core.sampling_params import SamplingParams

    async def main() -> list[str]:
        one_at_a_time = {"max_num_seqs": 1, "scheduling_policy": policy}
        config = controller_config(
            tiny_model_dir, mode="local", topology="colocated", decode=one_at_a_time
        )
        tenants = [TenantConfig(name="chat"), TenantConfig(name="batch", priority=1)]
        config = with_tenants(config, tenants)
        controller = Controller(config)
        await controller.start()
        done: list[str] = []

        async def run(request_id: str, tenant: str, max_tokens: int) -> None:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            request = ServeRequest(request_id, [5, 6, 7], params, tenant=tenant)
            await controller.submit(request).collect()
            done.append(request_id)

        try:
            batch = [asyncio.ensure_future(run(f"batch-{i}", "batch", 48)) for i in range(4)]
            for _ in range(400):  # until all four sit in the engine
                await asyncio.sleep(0.005)
                if not len(controller.buckets):
                    break
            assert len(controller.buckets) == 0
            chat = [asyncio.ensure_future(run(f"chat-{i}", "chat", 4)) for i in range(2)]
            await asyncio.gather(*batch, *chat)
            stats = await controller.drain(30)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        return done

    done = asyncio.run(main())
    if policy == "priority":
        assert done.index("chat-1") < done.index("batch-2"), done
    else:
        assert done[-2:] == ["chat-0", "chat-1"], done


def _request(request_id: str, prompt: list[int], params: Any) -> Any:
    from bucketserve.messages import ServeRequest

    return ServeRequest(request_id, list(prompt), params)


@pytest.mark.parametrize("topology", ["colocated", "disaggregated"])
def test_n_samples_end_with_an_error_when_their_decode_worker_dies(
    tiny_model_dir: Path, topology: str
) -> None:
    """A request of n > 1 samples that streamed tokens is not re-prefilled: every sample
    ends, with an error, and the pools drain."""
    from bucketserve.messages import ServeRequest
    from bucketserve.runtime.core.sampling_params import SamplingParams

    async def main() -> None:
        config = controller_config(tiny_model_dir, mode="local", topology=topology)
        controller = Controller(config)
        await controller.start()
        try:
            params = SamplingParams(temperature=0.8, max_tokens=200, ignore_eos=True, n=3)
            stream = controller.submit(ServeRequest("fan", list(range(100, 120)), params))
            deltas = [await anext(stream)]
            while not any(d.index > 0 and d.token_ids for d in deltas):
                deltas.append(await anext(stream))
            await controller.kill_worker("decode-0")
            deltas += [d async for d in stream]
            stats = await controller.drain(30)
        finally:
            await controller.shutdown()
        ends = {d.index: d.finish_reason for d in deltas if d.finish_reason}
        assert ends == {0: "error", 1: "error", 2: "error"}
        assert deltas[-1].finished and sum(d.finished for d in deltas) == 1
        assert "not re-prefilled" in deltas[-1].error
        assert_drained(stats)

    asyncio.run(main())
