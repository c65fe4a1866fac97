"""One local-mode backend for the whole gateway suite, and servers over it on free ports."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bucketserve.bucket_manager.config import TenantConfig
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.server import GatewayServer
from bucketserve.gateway.tenant_registry import TenantRegistry
from tests.gateway.loop_thread import LoopThread
from tests.worker_threads import worker_threads

BLOCK_SIZE = 4
NUM_KV_BLOCKS = 256
TENANTS = [
    {"name": "alice", "api_keys": ["alice-key"]},
    {"name": "bob", "api_keys": ["bob-key"], "class": "offline", "policy": "sjf"},
    {"name": "solo", "api_keys": ["solo-key"], "max_concurrent_requests": 1},
    {"name": "metered", "api_keys": ["metered-key"], "token_rate_limit": 0.01, "token_burst": 60},
    {"name": "slo", "api_keys": ["slo-key"], "ttft_slo_s": 60.0, "tpot_slo_s": 60.0},
]


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def tenant_registry() -> TenantRegistry:
    return TenantRegistry.from_dict(TENANTS)


def local_controller_config(model_dir: Path, tenants: list[TenantConfig], **options: Any) -> Any:
    """All workers in this process: the fast path every gateway test but the Ray one uses
    (whose actors' pools take this test process's share of the cores, `worker_threads`)."""
    from bucketserve.controller.config import ControllerConfig
    from bucketserve.deploy.serve_config import with_tenants
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    runner = ModelRunnerConfig(
        model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS
    )
    placement = {"torch_threads": worker_threads()}
    options = {
        "mode": "local", "stats_interval_s": 0.2, "topology": "disaggregated",
        "prefill": placement, "decode": placement, **options,
    }  # fmt: skip
    return with_tenants(ControllerConfig(runner=runner, **options), tenants)


@pytest.fixture(scope="session")
def backend(loop_thread: LoopThread, tiny_model_dir: Path, tenant_registry: TenantRegistry) -> Any:
    """The real Controller in local mode, serving the tiny model, knowing every test tenant
    (and `default`, the open server's)."""
    from bucketserve.controller.controller import Controller

    tenants = [*tenant_registry.bucket_configs(), TenantConfig(name="default")]
    controller = loop_thread.call(
        lambda: Controller(local_controller_config(tiny_model_dir, tenants))
    )
    loop_thread.run(controller.start())
    yield controller
    loop_thread.run(controller.shutdown())


def start_server(
    loop_thread: LoopThread, backend: Any, tenants: TenantRegistry | None = None, **config: Any
) -> GatewayServer:
    config = {"grpc_port": 0, "http_port": 0, **config}
    server = loop_thread.call(lambda: GatewayServer(backend, GatewayConfig(**config), tenants))
    loop_thread.run(server.start())
    return server


@pytest.fixture(scope="session")
def open_server(loop_thread: LoopThread, backend: Any) -> Iterator[GatewayServer]:
    """No tenants configured: no key needed, everything is tenant `default`."""
    server = start_server(loop_thread, backend)
    yield server
    loop_thread.run(server.stop(0))


@pytest.fixture(scope="session")
def tenant_server(
    loop_thread: LoopThread, backend: Any, tenant_registry: TenantRegistry
) -> Iterator[GatewayServer]:
    server = start_server(loop_thread, backend, tenant_registry)
    yield server
    loop_thread.run(server.stop(0))


def fresh_stats(loop_thread: LoopThread, backend: Any) -> Any:
    """stats() after every worker reported anew."""
    loop_thread.run(backend.refresh_stats())
    return loop_thread.call(backend.stats)


def wait_until_idle(loop_thread: LoopThread, backend: Any, timeout: float = 30.0) -> Any:
    """The stats once nothing runs or waits and every worker's blocks are free again (or
    `timeout` passed: the caller's asserts then say what is left)."""
    return loop_thread.run(backend.drain(timeout), timeout=timeout + 10)


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def http_post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers
