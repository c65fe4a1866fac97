"""`bucketserve serve`: build the controller and the gateway from a config file and flags,
serve until SIGINT / SIGTERM, then drain and stop."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from bucket_manager.config import TenantConfig
from gateway.gateway_config import GatewayConfig, known_keys
from gateway.server import GatewayServer
from gateway.tenant_registry import TenantRegistry

SECTIONS = ("gateway", "tenants", "controller")


class ServiceRunner:
    def __init__(
        self, controller: Any, gateway: GatewayConfig, tenants: TenantRegistry
    ) -> None:
        self.controller_config = controller
        self.gateway_config = gateway
        self.tenants = tenants

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServiceRunner:
        """The config file's sections, then the flags over them; ValueError names what is
        wrong."""
        data = _read_config(args.config) if args.config else {}
        gateway = dict(data.get("gateway") or {})
        for key in ("grpc_port", "http_port", "host"):
            if getattr(args, key) is not None:
                gateway[key] = getattr(args, key)
        tenants = TenantRegistry.from_dict(data.get("tenants"))
        controller = dict(data.get("controller") or {})
        if args.model:
            controller["runner"] = {**(controller.get("runner") or {}), "model": args.model}
        if args.ray_address:
            controller["ray_address"] = args.ray_address
        if args.local:
            controller["mode"] = "local"
        gateway_config = GatewayConfig.from_dict(gateway)
        return cls(controller_config(controller, tenants), gateway_config, tenants)

    def run(self) -> int:
        return asyncio.run(self.serve())

    async def serve(self, ready: asyncio.Event | None = None) -> int:
        from deploy.controller import Controller

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


def controller_config(data: dict[str, Any], tenants: TenantRegistry) -> Any:
    """A ControllerConfig from the `controller` mapping (nested mappings for runner,
    scheduler, placements and buckets); the embedded default is 1 prefill + 1 decode Ray
    actor on CPU with SmolLM2. The tenants become the bucket manager's."""
    from bucket_manager.config import BucketManagerConfig
    from deploy.controller_config import ControllerConfig, PlacementConfig
    from runtime.model_runner import ModelRunnerConfig
    from runtime.scheduler import SchedulerConfig

    nested = {
        "runner": ModelRunnerConfig,
        "scheduler": SchedulerConfig,
        "prefill_placement": PlacementConfig,
        "decode_placement": PlacementConfig,
    }
    kwargs = known_keys(ControllerConfig, data, "controller")
    for key, cls in nested.items():
        if isinstance(kwargs.get(key), dict):
            kwargs[key] = cls(**known_keys(cls, kwargs[key], f"controller.{key}"))
    buckets = kwargs.get("buckets")
    if isinstance(buckets, dict):
        kwargs["buckets"] = BucketManagerConfig.from_dict(buckets, "controller.buckets")
    try:
        config = ControllerConfig(**kwargs)
    except TypeError as exc:
        raise ValueError(f"controller: {exc}") from exc
    return with_tenants(config, tenants.bucket_configs())


def with_tenants(config: Any, tenants: Sequence[TenantConfig]) -> Any:
    """`config` whose bucket manager serves these tenants' policies. Without bucket settings
    these are the controller's defaults for the model (its derived request and shape
    buckets), which need the model's length."""
    from deploy.controller_config import default_buckets
    from runtime.model_config import ModelConfig
    from runtime.weights import resolve_model

    base = config.buckets
    if base is None:
        model = ModelConfig.from_dir(resolve_model(config.runner.model))
        max_len = config.runner.max_model_len or model.max_position_embeddings
        base = default_buckets(max_len, config.runner.block_size, config.scheduler.max_num_seqs)
    return dataclasses.replace(config, buckets=dataclasses.replace(base, tenants=tuple(tenants)))


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


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from exc
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path} must be a mapping with sections {list(SECTIONS)}")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{path}: unknown sections {unknown}; allowed: {list(SECTIONS)}")
    return data
