"""Prefill on one Ray node, decode on another (slow: a two-node `ray.cluster_utils.Cluster`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketserve.controller.controller import Controller
from tests.disagg.helpers import controller_config, serve_and_drain

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[str]:
    import ray
    from ray.cluster_utils import Cluster

    ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"prefill_node": 1}},
    )
    cluster.add_node(num_cpus=1, resources={"decode_node": 1})
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()


def test_kv_crosses_nodes_through_the_object_store(
    two_nodes: str, tiny_model_dir: Path, work: list, reference: list
) -> None:
    def pinned(label: str) -> dict:
        return {"accelerator": "none", "resources": {label: 1}}

    config = controller_config(
        tiny_model_dir, mode="ray", ray_address=two_nodes,
        prefill=pinned("prefill_node"), decode=pinned("decode_node"),
    )

    async def main() -> None:
        controller = Controller(config)
        await controller.start()
        outputs, stats = await serve_and_drain(controller, work, "nodes")
        assert outputs == reference
        prefill, decode = stats.worker("prefill-0"), stats.worker("decode-0")
        assert prefill.node_id != decode.node_id
        assert {prefill.transport, decode.transport} == {"ray"}
        assert stats.kv_bytes_moved == prefill.kv_bytes_sent > 0

    asyncio.run(main())
