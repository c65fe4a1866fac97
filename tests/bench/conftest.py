"""A real in-process service (local-mode controller over the tiny model + gateway) with two
tenants, on free ports, for the bench's end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bucketserve.gateway.tenant_registry import TenantRegistry
from tests.gateway.loop_thread import LoopThread

TENANTS = [
    {"name": "chat", "api_keys": ["chat-key"]},
    {"name": "batch", "api_keys": ["batch-key"], "class": "offline", "policy": "sjf",
     "priority": 1},
]


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def service(loop_thread: LoopThread, tiny_model_dir: Path) -> Iterator[tuple[Any, Any]]:
    """(controller, gateway server)."""
    from bucketserve.controller.config import ControllerConfig
    from bucketserve.controller.controller import Controller
    from bucketserve.deploy.serve_config import with_tenants
    from bucketserve.gateway.gateway_config import GatewayConfig
    from bucketserve.gateway.server import GatewayServer
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    tenants = TenantRegistry.from_dict(TENANTS)
    runner = ModelRunnerConfig(model=str(tiny_model_dir), block_size=4, num_kv_blocks=512)
    config = with_tenants(
        ControllerConfig(runner=runner, mode="local", stats_interval_s=0.2),
        tenants.bucket_configs(),
    )
    controller = loop_thread.call(lambda: Controller(config))
    loop_thread.run(controller.start())
    gateway = GatewayConfig(grpc_port=0, http_port=0)
    server = loop_thread.call(lambda: GatewayServer(controller, gateway, tenants))
    loop_thread.run(server.start())
    yield controller, server
    loop_thread.run(server.stop(0))
    loop_thread.run(controller.shutdown())
