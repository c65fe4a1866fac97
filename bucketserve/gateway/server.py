"""The gateway: gRPC and HTTP front ends over one admission path and one backend."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging

from bucketserve.gateway.admission import Admission
from bucketserve.gateway.backend import Backend
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.grpc_server import GrpcServer
from bucketserve.gateway.http_server import HttpServer
from bucketserve.gateway.metrics import GatewayMetrics
from bucketserve.gateway.tenant_registry import TenantRegistry

logger = logging.getLogger(__name__)


class GatewayServer:
    """Serves a started backend; `stop()` drains, and the backend's owner shuts it down.

    Each server has its own metrics registry, so several can live in one process.
    """

    def __init__(
        self,
        backend: Backend,
        config: GatewayConfig | None = None,
        tenants: TenantRegistry | None = None,
    ) -> None:
        self.config = config = config or GatewayConfig()
        self.backend = backend
        self.tenants = tenants or TenantRegistry()
        self.model_name = config.served_model_name or backend.model_info.name
        self.metrics = GatewayMetrics(self.model_name, backend.stats)
        self.admission = Admission(backend, self.tenants, self.metrics, config)
        self.grpc = GrpcServer(config, self.admission, self.model_name)
        self.http = (
            HttpServer(config, self.admission, self.metrics, self.model_name)
            if config.http_port is not None
            else None
        )
        self._health: asyncio.Task | None = None

    @property
    def grpc_target(self) -> str:
        return f"{_connect_host(self.config.host)}:{self.grpc.port}"

    @property
    def http_url(self) -> str | None:
        if self.http is None:
            return None
        scheme = "https" if self.config.tls else "http"
        return f"{scheme}://{_connect_host(self.config.host)}:{self.http.port}"

    async def start(self) -> None:
        await self.grpc.start()
        if self.http is not None:
            try:
                await self.http.start()
            except BaseException:
                await self.grpc.stop(0)
                raise
        self._health = asyncio.get_running_loop().create_task(
            self.grpc.track_health(self.backend.serving)
        )
        logger.info("serving %s: gRPC %s, HTTP %s", self.model_name, self.grpc_target,
                    self.http_url)
        for warning in exposure_warnings(self.config, self.tenants):
            logger.warning("%s", warning)
        for warning in demo_key_warnings(self.tenants):
            logger.warning("%s", warning)

    async def stop(self, grace_s: float | None = None) -> int:
        """Refuse new requests, let running ones finish for `grace_s` (default the config's
        drain_timeout_s), cancel the rest with a final message, then close both ports.
        Returns how many requests were cancelled."""
        grace = self.config.drain_timeout_s if grace_s is None else grace_s
        await self.grpc.not_serving()
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        cancelled = await self.admission.drain(grace)
        await self.grpc.stop(1.0)
        if self.http is not None:
            await self.http.stop()
        self.admission.close()
        return cancelled


def exposure_warnings(config: GatewayConfig, tenants: TenantRegistry) -> list[str]:
    """What is open to the network: nothing when bound to loopback."""
    if _is_loopback(config.host):
        return []
    out = []
    if not tenants.auth_required:
        out.append(
            f"serving {config.host} without tenants: anyone who reaches this address can "
            "generate, with no API key; configure tenants (their api_key_sha256) to require one"
        )
    if not config.tls:
        out.append(
            f"serving {config.host} without TLS: prompts, outputs and API keys cross the "
            "network in clear text; set gateway.tls_cert_file and gateway.tls_key_file"
        )
    if tenants.auth_required and not config.metrics_auth and config.http_port is not None:
        out.append(
            f"serving /metrics on {config.host} without a key: it names the tenants and "
            "their usage; set gateway.metrics_auth to true to require a tenant's key"
        )
    return out


def demo_key_warnings(tenants: TenantRegistry) -> list[str]:
    """One line per tenant that accepts a key whose plaintext ships with the project."""
    return [
        f"tenant {tenant.name!r} accepts the demo API key {key!r}, whose plaintext ships in "
        "bucketserve/deploy/serve.yaml: anyone who reaches this server can use it. Replace "
        "the tenant's api_key_sha256 with the digest of a key of your own, e.g. from "
        "python -c \"import hashlib, secrets; k = secrets.token_urlsafe(32); "
        "print(k, hashlib.sha256(k.encode()).hexdigest())\""
        for tenant in tenants.tenants.values()
        for key in tenant.demo_keys
    ]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
