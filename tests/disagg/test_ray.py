"""The disaggregated pipeline over Ray actors on one node (slow: the package's Ray session,
`ray_cards`, which fakes four Gaudi cards; tests that do not ask for them place every actor
on CPU)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from bucketserve.controller.controller import Controller
from tests.disagg.helpers import (
    assert_drained,
    controller_config,
    generate,
    generate_signalling,
    serve_and_drain,
    small_batches,
    tokens,
)

pytestmark = pytest.mark.slow
CPU = {"accelerator": "none"}


def ray_config(model_dir: Path, **options: Any) -> Any:
    placement = {"prefill": CPU, "decode": CPU}
    return controller_config(model_dir, mode="ray", **{**placement, **options})


def test_object_store_1p1d_matches_the_engine_and_survives_a_decode_kill(
    ray_cards: None, tiny_model_dir: Path, work: list, reference: list,
    long_work: list, long_reference: list, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layers are pushed to the decode actor as they are computed; the prefill actor's first
    life exits with its first batch one layer out (a crash mid-stream), then the decode
    actor is killed mid-generation: nothing is lost either time."""
    from bucketserve.controller.worker_pool import WorkerPool

    built = WorkerPool.prefill_config
    monkeypatch.setattr(
        WorkerPool, "prefill_config",
        lambda self, i: built(self, i).model_copy(update={"exit_after_layers": 1}),
    )  # fmt: skip

    async def main() -> None:
        controller = Controller(ray_config(tiny_model_dir, buckets=small_batches()))
        await controller.start()
        try:
            assert tokens(await generate(controller, work, "ray")) == reference
            stats = await controller.drain(30)
            assert_drained(stats)
            assert {w.transport for w in stats.workers} == {"ray"}
            assert all(w.node_id not in ("", "local") for w in stats.workers)
            assert stats.kv_bytes_moved > 0 and stats.transfers >= 4
            old_boot = stats.worker("decode-0").boot_id

            first = asyncio.Event()
            run = asyncio.ensure_future(generate_signalling(controller, long_work, first))
            await first.wait()
            await controller.kill_worker("decode-0")  # a real crash: Ray restarts the actor
            assert tokens(await run) == long_reference
            stats = await controller.drain(60)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        decode = stats.worker("decode-0")
        assert decode.restarts == 1 and decode.boot_id != old_boot
        assert stats.worker("prefill-0").restarts == 1  # the drill's exit
        assert stats.requests_requeued >= 1
        assert sum(stats.finish_reasons.values()) == 2 * len(work)

    asyncio.run(main())


def test_2p2d_places_one_prefill_actor_per_hpu_card_and_matches_the_engine(
    ray_cards: None, tiny_model_dir: Path, work: list, reference: list
) -> None:
    async def main() -> None:
        config = ray_config(
            tiny_model_dir, buckets=small_batches(),
            prefill={"num_workers": 2, "accelerator": "auto"}, decode={**CPU, "num_workers": 2},
        )
        controller = Controller(config)
        await controller.start()
        infos = controller.pool.infos
        outputs, stats = await serve_and_drain(controller, work, "hpu")
        assert outputs == reference
        cards = [infos[f"prefill-{i}"]["accelerator_ids"] for i in range(2)]
        assert len({c["HPU"][0] for c in cards}) == 2 and all(len(c["HPU"]) == 1 for c in cards)
        assert all("HPU" not in infos[f"decode-{i}"]["accelerator_ids"] for i in range(2))
        assert all(w.batches > 0 and w.transport == "ray" for w in stats.workers)

    asyncio.run(main())


def test_a_fifth_hpu_prefill_actor_is_refused_with_a_clear_error(
    ray_cards: None, tiny_model_dir: Path
) -> None:
    config = ray_config(
        tiny_model_dir, prefill={"num_workers": 5, "accelerator": "hpu"}
    )
    controller = Controller(config)
    options = controller.pool.actor_options("prefill", config.prefill)
    assert options["resources"] == {"HPU": 1} and "num_gpus" not in options
    # restartable, and the call that crashed an actor is not re-run by Ray behind our back
    assert options["max_restarts"] == -1 and options["max_task_retries"] == 0
    with pytest.raises(ValueError, match="HPU: 5 wanted, 4 in the cluster"):
        asyncio.run(controller.start())


def test_collective_transport_over_gloo_matches_the_engine_and_survives_a_prefill_kill(
    ray_cards: None, tiny_model_dir: Path, work: list, reference: list,
    long_work: list, long_reference: list,
) -> None:
    """torch.distributed point-to-point between actor processes (gloo on CPU), one group per
    prefill/decode pair: a killed prefill re-forms only its own pair."""

    async def main() -> None:
        controller = Controller(ray_config(tiny_model_dir, transport="collective",
                                           prefill={**CPU, "num_workers": 2},
                                           buckets=small_batches()))
        await controller.start()
        try:
            assert tokens(await generate(controller, work, "gloo")) == reference
            first = asyncio.Event()
            run = asyncio.ensure_future(generate_signalling(controller, long_work, first))
            await first.wait()
            await controller.kill_worker("prefill-0")
            assert tokens(await run) == long_reference
            assert tokens(await generate(controller, work, "again")) == reference
            stats = await controller.drain(60)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        assert {w.transport for w in stats.workers} == {"collective"}
        assert stats.worker("prefill-0").restarts == 1
        assert stats.transfers >= 8

    asyncio.run(main())
