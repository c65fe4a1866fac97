"""Starts `bucketserve serve` with a given controller config in a child process, on free
loopback ports, and stops it (SIGINT: drain, then shut down) when done."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
import urllib.request
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(controller: Any, grpc_port: int, http_port: int, tenants: list[dict] | None) -> None:
    from bucketserve.deploy.service_runner import ServiceRunner
    from bucketserve.gateway.gateway_config import GatewayConfig
    from bucketserve.gateway.tenant_registry import TenantRegistry

    gateway = GatewayConfig(grpc_port=grpc_port, http_port=http_port, drain_timeout_s=5.0)
    ServiceRunner(controller, gateway, TenantRegistry.from_dict(tenants)).run()


class ServiceHarness:
    """`with ServiceHarness(config, tenants) as service:` serves on `service.target` (gRPC)
    and `service.http_url`; the controller config is a ControllerConfig."""

    def __init__(
        self, controller: Any, tenants: list[dict] | None = None, start_timeout_s: float = 300.0
    ) -> None:
        self.controller = controller
        self.tenants = tenants
        self.start_timeout_s = start_timeout_s
        self.grpc_port, self.http_port = free_port(), free_port()
        self.process: multiprocessing.process.BaseProcess | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def __enter__(self) -> ServiceHarness:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        args = (self.controller, self.grpc_port, self.http_port, self.tenants)
        self.process = ctx.Process(target=_serve, args=args, daemon=True)
        self.process.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._healthy():
            if not self.process.is_alive():
                raise RuntimeError(f"the service exited with code {self.process.exitcode} "
                                   "before it was ready (its log is above)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the service was not ready in {self.start_timeout_s:g}s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is None or not self.process.is_alive():
            return
        os.kill(self.process.pid, signal.SIGINT)
        self.process.join(30)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(10)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.http_url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False
