"""`bucketserve serve`: build the controller and the gateway from a config file and flags,
wire them, serve until SIGINT / SIGTERM, then drain and stop."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from bucketserve.controller.config import ControllerConfig
from bucketserve.controller.controller import Controller
from bucketserve.deploy.listener_audit import ListenerAudit
from bucketserve.deploy.serve_config import ServeConfig
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.gateway.server import GatewayServer
from bucketserve.gateway.tenant_registry import TenantRegistry


class ServiceRunner:
    def __init__(
        self, controller: ControllerConfig, gateway: GatewayConfig, tenants: TenantRegistry
    ) -> None:
        self.controller_config = controller
        self.gateway_config = gateway
        self.tenants = tenants

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServiceRunner:
        """The service YAML (bucketserve/deploy/serve.yaml's schema), then the flags over it; a
        ServeConfigError (a ValueError) names the file, the key path and what is allowed."""
        config = ServeConfig.load(args.config, flag_overrides(args))
        return cls(config.controller_config(), config.gateway, config.tenants)

    def run(self) -> int:
        return asyncio.run(self.serve())

    async def serve(self, ready: asyncio.Event | None = None) -> int:

        mode = self.controller_config.mode
        say(f"starting the controller ({mode} mode): loading the model and warming up...")
        controller = Controller(self.controller_config)
        await controller.start()
        server = GatewayServer(controller, self.gateway_config, self.tenants)
        try:
            await server.start()
        except BaseException:
            await controller.shutdown()
            raise
        await asyncio.to_thread(self.audit_listeners, server)
        print(banner(server), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready.set()
        await stop.wait()
        running = len(server.admission.running)
        say(f"shutting down: {running} requests running, waiting up to "
            f"{self.gateway_config.drain_timeout_s:g}s for them (Ctrl-C again to cancel them)")
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.admission.hurry)
        cancelled = await server.stop()
        await controller.shutdown()
        say(f"stopped: {running - cancelled} running requests finished, {cancelled} cancelled")
        return 0

    def audit_listeners(self, server: GatewayServer) -> None:
        """Log what listens beyond loopback that the config did not ask for (the gateway's
        two ports are asked for, whatever host they bind)."""
        pid = os.getpid()
        ports = [server.grpc.port] + ([server.http.port] if server.http is not None else [])
        cluster = self.controller_config.ray_address is not None
        ListenerAudit((pid, port) for port in ports).report(cluster)


def flag_overrides(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """{config key path: (value, flag)} for the `serve` flags given."""
    flags = {
        "grpc_port": ("gateway.grpc_port", "--grpc-port"),
        "http_port": ("gateway.http_port", "--http-port"),
        "host": ("gateway.host", "--host"),
        "model": ("model.path", "--model"),
        "chat_template": ("model.chat_template", "--chat-template"),
        "quantization": ("model.quantization", "--quantization"),
        "tool_call_parser": ("model.tool_call_parser", "--tool-call-parser"),
        "ray_address": ("controller.ray_address", "--ray-address"),
    }
    overrides = {
        path: (getattr(args, name), flag)
        for name, (path, flag) in flags.items()
        if getattr(args, name, None) is not None
    }
    if args.local:
        overrides["controller.mode"] = ("local", "--local")
    return overrides


def banner(server: GatewayServer) -> str:
    """How to call the running server: SDK, CLI, curl and the openai package."""
    grpc, http = server.grpc_target, server.http_url
    auth = server.tenants.auth_required
    key_flag = " --api-key $BUCKETSERVE_API_KEY" if auth else ""
    key_header = ' -H "Authorization: Bearer $BUCKETSERVE_API_KEY"' if auth else ""
    key_arg = 'api_key="<your key>"' if auth else 'api_key="none"'
    lines = [
        f"bucketserve is serving {server.model_name}",
        f"  gRPC  {grpc}  (bucketserve.v1.Generation, grpc.health.v1, reflection)",
    ]
    if http:
        lines.append(f"  HTTP  {http}  (OpenAI API under /v1, /metrics, /health)")
    lines += [
        "",
        "Call it:",
        f'  bucketserve generate "Once upon a time" --target {grpc}{key_flag}',
        f"  python -c 'from bucketserve import Client; "
        f'print(Client("{grpc}").generate("Once upon a time").text)\'',
    ]
    if http:
        lines += [
            f"  curl {http}/v1/completions -H 'Content-Type: application/json'{key_header} "
            f"-d '{{\"prompt\": \"Once upon a time\", \"max_tokens\": 32}}'",
            f'  openai: OpenAI(base_url="{http}/v1", {key_arg})',
        ]
    if auth:
        lines.append("Tenants are configured: send a tenant's key ($BUCKETSERVE_API_KEY).")
    lines.append("Ctrl-C drains running requests and stops.")
    return "\n".join(lines)


def say(message: str) -> None:
    print(f"bucketserve serve: {message}", file=sys.stderr, flush=True)
