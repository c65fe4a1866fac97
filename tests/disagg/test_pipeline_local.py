"""1 prefill + 1 decode worker in process, each a 2-stage group on threads (3 layers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bucketserve.controller.controller import Controller
from tests.disagg.helpers import (
    controller_config,
    mixed_workload,
    reference_outputs,
    serve_and_drain,
    small_batches,
)

TWO = {"pipeline_parallel_size": 2}


def test_local_2_stage_groups_match_one_stage(tiny_model_factory) -> None:
    model: Path = tiny_model_factory(num_hidden_layers=3)
    work = mixed_workload(8)
    reference = reference_outputs(model, work)

    async def main() -> None:
        config = controller_config(  # every prompt through the prefill stages
            model, mode="local", buckets=small_batches(), remote_prefill="always",
            prefill=TWO, decode=TWO,
        )
        controller = Controller(config)
        await controller.start()
        prefill = controller.pool.by_name("prefill-0").worker
        decode = controller.pool.by_name("decode-0").worker
        outputs, stats = await serve_and_drain(controller, work, "local-pp")
        assert outputs == reference
        assert {w.pipeline_stages for w in stats.workers} == {2}
        assert stats.kv_bytes_moved > 0
        # two prefill batches in the prefill stages at once (controller.prefill.max_batches 2),
        # two decode microbatches in the decode stages
        assert prefill.runner.peak_in_flight == 2 and decode.runner.peak_in_flight == 2

    asyncio.run(main())
