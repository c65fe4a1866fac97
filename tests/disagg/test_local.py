"""The disaggregated pipeline with every worker in this process (in-process KV transport)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bucketserve.controller.controller import Controller
from bucketserve.runtime.core.sampling_params import SamplingParams
from tests.disagg.helpers import (
    BLOCK_SIZE,
    assert_drained,
    controller_config,
    generate,
    generate_killing,
    serve_and_drain,
    small_batches,
    tokens,
)

LEASE_TTL_S = 3.0  # far above a handoff of the tiny model's KV, however loaded the machine
HANG_TIMEOUT_S = 5.0  # likewise above any step or batch of it: only the drilled hang trips it
EVENT_TIMEOUT_S = 120.0  # what a drill waits for at most before it gives up


async def started(model_dir: Path, **options: Any) -> Controller:
    controller = Controller(controller_config(model_dir, mode="local", **options))
    await controller.start()
    return controller


@pytest.mark.parametrize(("num_prefill", "num_decode"), [(1, 1), (2, 2)])
def test_matches_the_in_process_engine(
    tiny_model_dir: Path, work: list, reference: list, num_prefill: int, num_decode: int
) -> None:
    async def main() -> None:
        controller = await started(
            tiny_model_dir, prefill={"num_workers": num_prefill},
            decode={"num_workers": num_decode}, buckets=small_batches(),
        )
        outputs, stats = await serve_and_drain(controller, work, "local")
        assert outputs == reference
        assert all(w.batches > 0 and w.transport == "inprocess" for w in stats.workers)
        assert stats.transfers >= 4 and stats.requests_requeued == 0
        assert sum(stats.finish_reasons.values()) == len(work)

    asyncio.run(main())


def test_requests_that_end_at_their_first_token_ship_no_kv(
    tiny_model_dir: Path, work: list, reference: list
) -> None:
    """max_tokens=1 ends a request at the prefill's token: its KV is neither reserved on nor
    sent to a decode worker. A batch of only such requests transfers nothing; in a mixed
    run exactly the other requests' KV moves."""
    one = SamplingParams(temperature=0, max_tokens=1)
    ending = [(prompt, one) for prompt, _ in work[::2]]
    going_on = work[1::2]
    mixed = [item for pair in zip(ending, going_on, strict=True) for item in pair]

    async def run(part: list, tag: str) -> tuple[list[list[int]], Any]:
        controller = await started(tiny_model_dir, buckets=small_batches())
        outputs, stats = await serve_and_drain(controller, part, tag)
        assert stats.requests_requeued == 0
        return outputs, stats

    async def main() -> None:
        outputs, stats = await run(ending, "ending")
        assert outputs == [r[:1] for r in reference[::2]]
        assert stats.transfers == 0 and stats.kv_bytes_moved == 0
        outputs, stats = await run(mixed, "mixed")
        pairs = zip(reference[::2], reference[1::2], strict=True)
        assert outputs == [r for first, rest in pairs for r in (first[:1], rest)]
        _, alone = await run(going_on, "going-on")
        assert 0 < stats.kv_bytes_moved == alone.kv_bytes_moved

    asyncio.run(main())


def test_padded_to_warmed_shape_buckets_matches_the_engine(
    tiny_model_dir: Path, work: list, reference: list, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefill batches padded to prompt shapes, decode batches to decode shapes, every shape
    warmed (and logged) at start: same tokens, no graph miss."""
    caplog.set_level(logging.INFO, logger="bucketserve.kv_worker.kv_worker")

    async def main() -> None:
        controller = await started(tiny_model_dir, pad_to_shape_buckets=True, warmup="auto")
        infos = controller.pool.infos
        outputs, stats = await serve_and_drain(controller, work, "padded")
        assert outputs == reference
        assert all(w.graph_misses == 0 for w in stats.workers)
        buckets = controller.buckets.config.shape_buckets
        prompt = infos["prefill-0"]
        assert prompt["padding"] and prompt["seconds"] > 0
        # batch 1..16 x query 4..512 (two per doubling), all warmed
        assert len(prompt["shapes"]) == 5 * 15
        assert len(infos["decode-0"]["shapes"]) == 77  # batch b in 1..64 x blocks 1..b * 128
        assert buckets.block_size == BLOCK_SIZE
        assert {i["device_type"] for i in infos.values()} == {"cpu"}
        assert not controller.pool._all_on_accelerators()  # auto transport: not collective

    asyncio.run(main())
    text = caplog.text
    assert "prefill-0: warmed 75 of 75 prompt shapes" in text
    assert "decode-0: warmed 77 of 77 decode shapes" in text


def test_expired_lease_frees_the_prefill_blocks_and_the_request_completes(
    tiny_model_dir: Path, work: list, reference: list
) -> None:
    """The decode side's first admission is held until both leases of that handoff ran out
    (an event, not a clock, ends the hold); the batch is prefilled again and completes."""

    async def main() -> None:
        controller = await started(tiny_model_dir, lease_ttl_s=LEASE_TTL_S)
        release = threading.Event()
        try:
            worker = controller.pool.by_name("decode-0").worker
            admit, calls = worker.admit_prefilled, itertools.count()

            def held(*args: Any) -> Any:
                if next(calls) == 0:
                    release.wait(EVENT_TIMEOUT_S)
                return admit(*args)

            worker.admit_prefilled = held
            run = asyncio.ensure_future(generate(controller, work, "lease"))
            prefill = await _expired(controller, "prefill-0")
            # the admission is still held back, yet the prefill pool is whole again
            assert not run.done()
            assert prefill.num_free_blocks == prefill.num_total_blocks
            assert prefill.leases_open == 0
            release.set()
            assert tokens(await run) == reference
            stats = await controller.drain(30)
        finally:
            release.set()
            await controller.shutdown()
        assert_drained(stats)
        assert stats.worker("decode-0").leases_expired >= 1
        assert stats.requests_requeued >= 1

    asyncio.run(main())


async def _expired(controller: Controller, name: str) -> Any:
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    while time.monotonic() < deadline:
        await controller.refresh_stats()
        stats = controller.stats().worker(name)
        if stats.leases_expired:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError(f"no lease of {name} expired")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_killed_mid_request_is_restarted_and_nothing_is_lost(
    tiny_model_dir: Path, long_work: list, long_reference: list, role: str
) -> None:
    """Prefill killed while it holds a batch: the batch is retried. Decode killed mid
    generation: its requests are re-prefilled with what they streamed and complete."""

    async def main() -> None:
        controller = await started(tiny_model_dir, buckets=small_batches())
        try:
            assert tokens(await generate_killing(controller, long_work, role)) == long_reference
            stats = await controller.drain(30)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        assert stats.worker(f"{role}-0").restarts == 1 and stats.worker_restarts == 1
        if role == "decode":
            assert stats.requests_requeued >= 1

    asyncio.run(main())


def test_drain_waits_for_the_restart_of_a_worker_killed_while_idle(tiny_model_dir: Path) -> None:
    """Nothing calls an idle killed worker before the drain: the drain's own stats poll finds
    the death, and the drain returns only once the worker is back and counted."""

    async def main() -> None:
        controller = await started(tiny_model_dir)
        try:
            await controller.kill_worker("prefill-0")
            stats = await controller.drain(30)
        finally:
            await controller.shutdown()
        worker = stats.worker("prefill-0")
        assert worker.alive and worker.restarts == 1 and stats.worker_restarts == 1

    asyncio.run(main())


def test_an_unpadded_prefill_takes_a_whole_burst_past_the_warmed_batch_sizes(
    tiny_model_dir: Path, work: list, reference: list
) -> None:
    """On the CPU (no padding, no graphs) a burst of 32 goes out as one prefill batch, past the
    largest warmed prompt batch (16): the decode pool starts on all of it at once."""
    config = controller_config(tiny_model_dir, mode="local")
    runner = config.runner.model_copy(update={"num_kv_blocks": 1024})

    async def main() -> None:
        controller = Controller(config.model_copy(update={"runner": runner}))
        await controller.start()
        padded = controller.buckets.padded
        outputs, stats = await serve_and_drain(controller, work + work, "burst")
        assert not padded and outputs == reference * 2
        assert [w.batches for w in stats.workers if w.role == "prefill"] == [1]
        assert stats.transfers == 1 and stats.buckets.graph_misses == 0

    asyncio.run(main())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_hung_worker_is_detected_and_its_requests_complete(
    tiny_model_dir: Path, long_work: list, long_reference: list, role: str
) -> None:
    """A prefill batch or a decode step that does not end in worker_timeout_s (here: one that
    hangs until the controller has declared the worker dead) makes the worker hung: it is
    restarted, its work is done again on its new life, every request finishes with the
    engine's tokens and nothing leaks."""

    async def main() -> None:
        controller = await started(
            tiny_model_dir, buckets=small_batches(), worker_timeout_s=HANG_TIMEOUT_S
        )
        try:
            handle = controller.pool.by_name(f"{role}-0")
            worker = handle.worker
            owner, name = (worker.runner, "execute") if role == "prefill" else (
                worker.engine, "step"
            )
            real, calls = getattr(owner, name), itertools.count()

            def hanging(*args: Any, **kwargs: Any) -> Any:
                if next(calls) == (0 if role == "prefill" else 5):
                    deadline = time.monotonic() + EVENT_TIMEOUT_S
                    while handle.alive and time.monotonic() < deadline:
                        time.sleep(0.02)
                return real(*args, **kwargs)

            setattr(owner, name, hanging)
            assert tokens(await generate(controller, long_work, "hang")) == long_reference
            stats = await controller.drain(30)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        assert stats.worker(f"{role}-0").restarts == 1
        if role == "decode":
            assert stats.requests_requeued >= 1

    asyncio.run(main())
