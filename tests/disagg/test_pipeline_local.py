"""1 prefill + 1 decode worker in process, each a 2-stage group on threads (3 layers)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

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
        config = controller_config(  # every prompt through the prefill stages, to count them
            model, mode="local", buckets=small_batches(), remote_prefill="always",
            prefill=TWO, decode=TWO,
        )
        controller = Controller(config)
        await controller.start()
        prefill = controller.pool.by_name("prefill-0").worker
        decode = controller.pool.by_name("decode-0").worker
        hold_until_a_second_batch_enters(prefill.runner)
        outputs, stats = await serve_and_drain(controller, work, "local-pp")
        assert outputs == reference
        assert {w.pipeline_stages for w in stats.workers} == {2}
        assert stats.kv_bytes_moved > 0
        # two prefill batches in the prefill stages at once (controller.prefill.max_batches 2),
        # two decode microbatches in the decode stages
        assert prefill.runner.peak_in_flight == 2 and decode.runner.peak_in_flight == 2

    asyncio.run(main())


def hold_until_a_second_batch_enters(runner: Any, timeout_s: float = 120.0) -> None:
    """The first batch leaves the prefill stages only once a second has entered them (or
    `timeout_s` passed): how fast the stages run, which decides whether two batches ever
    meet there on a loaded machine, is not what the test checks; whether the controller
    sends the second batch while the first is still in flight is."""
    second = threading.Event()
    submit, result = runner.submit, runner.result

    def submit_and_note(*args: Any, **kwargs: Any) -> Any:
        microbatch = submit(*args, **kwargs)
        if runner.peak_in_flight >= 2:
            second.set()
        return microbatch

    def result_after_the_second(microbatch: Any) -> Any:
        second.wait(timeout_s)
        return result(microbatch)

    runner.submit, runner.result = submit_and_note, result_after_the_second
