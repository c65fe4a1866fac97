"""The simulator's P/D choices come from the service's own PDScheduler: the same sequence of
free-block states, fed through the simulator and through a local-mode Controller, picks the
same decode worker at every step."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.systems import build
from bucketserve.controller.controller import Controller
from tests.disagg.helpers import controller_config

NUM_DECODE = 3
NUM_BLOCKS = 160
# blocks each successive batch reserves on the worker picked for it
BATCH_BLOCKS = [30, 30, 30, 10, 25, 40, 5, 5, 15, 20, 35, 1, 12, 12]


def simulator_choices() -> list[int]:
    cluster = ClusterConfig(
        model="llama-2-7b", num_prefill=1, num_decode=NUM_DECODE, kv_blocks=NUM_BLOCKS,
        max_num_seqs=16,
    )
    sim = build("bucketserve", cluster)
    picks = []
    for step, blocks in enumerate(BATCH_BLOCKS):
        worker = sim.pick_decode()
        picks.append(worker.index)
        worker.reserve([step], [1], [blocks])  # room drops by the commitment
    return picks


def controller_choices(model_dir: Path) -> list[int]:
    async def main() -> list[int]:
        config = controller_config(
            model_dir, mode="local", decode={"num_workers": NUM_DECODE}, stats_interval_s=3600.0
        )
        controller = Controller(config)
        await controller.start()
        try:
            decodes = controller.pool.role("decode")
            for handle in decodes:  # the state the simulator starts from
                handle.stats = dataclasses.replace(
                    handle.stats, num_free_blocks=NUM_BLOCKS, num_total_blocks=NUM_BLOCKS,
                    running=0, waiting=0,
                )
            picks = []
            for blocks in BATCH_BLOCKS:
                handle = controller.pick_decode()
                picks.append(decodes.index(handle))
                handle.stats.num_free_blocks -= blocks  # its next report after the reservation
            return picks
        finally:
            await controller.shutdown()

    return asyncio.run(main())


def test_simulator_and_controller_pick_the_same_decode_workers(tiny_model_dir: Path) -> None:
    simulated = simulator_choices()
    served = controller_choices(tiny_model_dir)
    assert served == simulated
    assert simulated[:3] == [0, 1, 2]  # equal rooms: the lowest index first
    assert set(simulated) == set(range(NUM_DECODE))
