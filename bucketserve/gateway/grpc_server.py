"""The grpc.aio server: the Generation service, grpc.health.v1 and server reflection."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from bucketserve.gateway.access_log import AccessLog
from bucketserve.gateway.admission import Admission
from bucketserve.gateway.gateway_config import BindError, GatewayConfig
from bucketserve.gateway.grpc_servicer import GenerationServicer
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2 as pb
from bucketserve.gateway.proto.bucketserve.v1 import serving_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class GrpcServer:
    def __init__(self, config: GatewayConfig, admission: Admission, model_name: str) -> None:
        self.config = config
        self.health = health_aio.HealthServicer()
        self.server = grpc.aio.server(options=_options(config))
        pb_grpc.add_GenerationServicer_to_server(
            GenerationServicer(admission, model_name, AccessLog(config.log_prompts)), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), self.server)
        self.port: int | None = None
        self._draining = False

    async def start(self) -> int:
        """Binds and serves; returns the bound port."""
        address = f"{self.config.host}:{self.config.grpc_port}"
        if self.config.tls:
            key = Path(self.config.tls_key_file or "").read_bytes()
            cert = Path(self.config.tls_cert_file or "").read_bytes()
            credentials = grpc.ssl_server_credentials([(key, cert)])
            self.port = self.server.add_secure_port(address, credentials)
        else:
            self.port = self.server.add_insecure_port(address)
        if not self.port:
            raise BindError(
                f"cannot bind gRPC to {address}: is the port in use? "
                "Choose another port with gateway.grpc_port or --grpc-port"
            )
        await self.server.start()
        await self._set_health(True)
        return self.port

    async def track_health(self, serving: Callable[[], bool], interval_s: float = 0.25) -> None:
        """Keep grpc.health.v1 in step with `serving()` (a live worker for every phase)
        until the server drains; runs until cancelled."""
        last = True
        while not self._draining:
            now = serving()
            if now != last:
                await self._set_health(now)
                last = now
            await asyncio.sleep(interval_s)

    async def not_serving(self) -> None:
        """Health says NOT_SERVING (load balancers stop sending); calls still complete."""
        self._draining = True
        await self.health.enter_graceful_shutdown()

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status.SERVING if serving else status.NOT_SERVING)

    async def stop(self, grace_s: float | None = None) -> None:
        await self.server.stop(grace_s)


def _options(config: GatewayConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        # clients may ping this often while a long generation streams nothing new
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_pings_without_data", 0),
    ]
