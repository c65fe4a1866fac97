"""Workers as groups of pipeline stage actors on Ray (slow: the package's Ray session, 4 fake
cards).

The tiny Llama here has 3 layers, so 2 stages split them 2 + 1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bucketserve.controller.controller import Controller
from tests.disagg.helpers import (
    assert_drained,
    controller_config,
    generate,
    generate_signalling,
    mixed_workload,
    reference_outputs,
    small_batches,
    tokens,
)

pytestmark = pytest.mark.slow
STAGES = {"accelerator": "hpu", "num_cpus": 0.25, "pipeline_parallel_size": 2}


@pytest.fixture(scope="module")
def three_layers(tiny_model_factory) -> Path:
    return tiny_model_factory(num_hidden_layers=3)


def test_2_stage_prefill_and_decode_groups_take_two_cards_each_match_one_stage_and_survive_a_stage_kill(  # noqa: E501
    ray_cards: None, three_layers: Path
) -> None:
    import ray

    from bucketserve.runtime.core.sampling_params import SamplingParams

    work = mixed_workload(8)
    reference = reference_outputs(three_layers, work)  # one stage, in process
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    long_work = [(p, long) for p, _ in work]
    long_reference = reference_outputs(three_layers, long_work)

    async def main() -> None:
        config = controller_config(
            three_layers, mode="ray", buckets=small_batches(),
            prefill=STAGES, decode=STAGES,
        )
        controller = Controller(config)
        await controller.start()
        try:
            infos = controller.pool.infos
            cards = []
            for name in ("prefill-0", "decode-0"):
                stages = infos[name]["stages"]
                assert [s["layers"] for s in stages] == [[0, 2], [2, 3]]
                assert all(len(s["accelerator_ids"]["HPU"]) == 1 for s in stages)
                assert "HPU" not in infos[name]["accelerator_ids"]  # the head holds no card
                cards += [s["accelerator_ids"]["HPU"][0] for s in stages]
            assert sorted(cards) == ["0", "1", "2", "3"]

            assert tokens(await generate(controller, work, "pp")) == reference
            stats = await controller.drain(30)
            assert_drained(stats)
            decode = stats.worker("decode-0")
            assert decode.pipeline_stages == 2 and 0.0 <= decode.bubble_fraction < 1.0
            spans = await controller.pool.by_name("decode-0").call("pipeline_spans")
            assert any(  # stage 0 ran one microbatch while stage 1 ran another
                a.stage == 0 and b.stage == 1 and a.microbatch != b.microbatch
                and a.start < b.end and b.start < a.end
                for a in spans for b in spans
            ), spans

            victim = infos["decode-0"]["stages"][1]["actor"]
            first = asyncio.Event()
            run = asyncio.ensure_future(generate_signalling(controller, long_work, first))
            await first.wait()
            ray.kill(ray.get_actor(victim), no_restart=True)
            assert tokens(await run) == long_reference

            victim = infos["prefill-0"]["stages"][0]["actor"]  # mid-batch, or between
            run = asyncio.ensure_future(generate(controller, long_work, "prefill-kill"))
            await asyncio.sleep(0.1)
            ray.kill(ray.get_actor(victim), no_restart=True)
            assert tokens(await run) == long_reference
            for _ in range(600):  # its death is noticed by a call or the next stats poll
                if controller.pool.by_name("prefill-0").restarts == 1:
                    break
                await asyncio.sleep(0.1)
            assert tokens(await generate(controller, work, "after")) == reference
            stats = await controller.drain(60)
        finally:
            await controller.shutdown()
        assert_drained(stats)
        assert stats.worker("decode-0").restarts == 1
        assert stats.worker("prefill-0").restarts == 1
        assert stats.requests_requeued >= 1

    asyncio.run(main())
