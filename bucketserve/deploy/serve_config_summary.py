"""What a ServeConfig will start, in a few lines (`bucketserve config check`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bucketserve.deploy.serve_config import ServeConfig


def summarize(config: ServeConfig, model_len: int | None = None) -> str:
    c, g, runner = config.controller, config.gateway, config.controller.runner
    model = runner.model or "embedded SmolLM2-135M-Instruct"
    length = model_len or runner.max_model_len
    kv = (
        f"{runner.num_kv_blocks} blocks" if runner.num_kv_blocks is not None
        else f"{runner.kv_memory_fraction:g} of free memory"
    )
    lines = [
        f"model       {model}  (dtype {runner.dtype}, quantization {runner.quantization}, "
        f"device {runner.device}, "
        f"max_model_len {length or 'from the model'})",
        f"kv cache    block size {runner.block_size}, {kv} per decode worker, prefix caching "
        + ("on" if c.runner.enable_prefix_caching else "off"),
        f"topology    {c.topology}"
        + (": the decode workers prefill in chunks" if c.colocated else ""),
        f"prefill     {c.num_prefill_workers} worker(s)"
        + (f", each {_asks(config, 'prefill')}" if c.num_prefill_workers else ""),
        f"decode      {c.decode.num_workers} worker(s), each {_asks(config, 'decode')}; "
        f"max_num_seqs {c.decode.max_num_seqs}, pipeline depth {c.decode.pipeline_depth}",
        f"controller  mode {c.mode}"
        + (f", Ray at {c.ray_address or 'a new local instance'}" if c.mode == "ray" else "")
        + f", transport {c.transport}",
        f"buckets     {_shapes(config)}; request buckets θ {config.request_buckets.theta:g}, "
        f"L_max {length or 'the model length'}, at most {config.request_buckets.max_buckets}",
        f"tenants     {_tenants(config)}",
        f"gateway     gRPC {g.host}:{g.grpc_port}"
        + (f", HTTP {g.host}:{g.http_port}" if g.http_port is not None else ", no HTTP")
        + (", TLS" if g.tls else ", no TLS"),
    ]
    if config.cluster_resources:
        have = ", ".join(f"{k} {v:g}" for k, v in config.cluster_resources.items())
        lines.append(f"cluster     {have}")
    return "\n".join(lines)


def _asks(config: ServeConfig, role: str) -> str:
    asks = config.actor_resources(role)
    accelerator = config.controller.placement(role).accelerator
    text = ", ".join(f"{k} {v:g}" for k, v in asks.items()) or "nothing"
    return f"{text} (accelerator {accelerator})"


def _shapes(config: ServeConfig) -> str:
    shape = config.shape_buckets
    strategy = shape.get("strategy", "exponential")
    if strategy == "file":
        return f"shape buckets from {shape.get('file') or 'the environment variable'}"
    given = [k for k in ("prompt", "decode") if k in shape]
    ranges = f"{' and '.join(given)} as given" if given else "ranges from the model"
    return f"{strategy} shape buckets ({ranges})"


def _tenants(config: ServeConfig) -> str:
    registry = config.tenants
    if not registry.auth_required:
        return "none: open server, every request is tenant 'default' (no API key)"
    parts = []
    for t in registry.tenants.values():
        keys = len(t.api_key_hashes)
        parts.append(f"{t.name} ({t.tenant_class} {t.policy}, {keys} key{'s' * (keys > 1)})")
    return ", ".join(parts)
