"""The service config file (`bucketserve/deploy/serve.yaml`) as pydantic models: one per
section, each key with its type, default and allowed values, and its docstring as its entry
in the key reference (`docs/configuration.md`, generated from these models).

`ServeConfig` (serve_config.py) builds the controller's, the gateway's and the bucket
manager's configs from a validated `ServeSettings`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from annotated_types import Ge
from pydantic import AfterValidator, Field, field_validator, model_validator

from bucketserve.bucket_manager.config import BatchingConfig, RequestBucketConfig, TenantConfig
from bucketserve.controller.config import ControllerConfig, Execution
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.utils.settings import Settings, SettingsError

# The service's defaults are the configs' own: each default is written once, there.
CONTROLLER, REQUEST_BUCKETS = ControllerConfig(), RequestBucketConfig()
RUNNER = CONTROLLER.runner

DEVICES = ("auto", "cpu", "cuda", "cuda:<i>", "hpu")


def _device(device: str) -> str:
    name = device.strip().lower()
    if name in ("auto", "cpu", "cuda", "hpu") or re.fullmatch(r"cuda:\d+", name):
        return device
    raise ValueError(f"must be one of {list(DEVICES)}; got {device!r}")


def _chat_template(template: str | None) -> str | None:
    if template is None or "{{" in template or "{%" in template:
        return template
    if not Path(template).expanduser().is_file():
        raise ValueError(f"{template} is not a file (nor a Jinja template)")
    return template


class ModelSettings(Settings):
    path: str | None = None
    """HF model directory or .gguf file (on the head node); null: the embedded
    SmolLM2-135M-Instruct."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half"] = (
        RUNNER.dtype
    )
    """auto: float32 on CPU, bfloat16 on cuda and hpu."""
    quantization: Literal["auto", "none"] = RUNNER.quantization
    """auto: a GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K weights stay in their
    blocks on CPU workers (eager, float32, no tensor parallelism), other types expanded to
    float32; none: every weight expanded to float32."""
    device: Annotated[str, AfterValidator(_device)] = RUNNER.device
    """auto, cpu, cuda, cuda:<i> or hpu, as each worker sees it."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + output; null: the model's max_position_embeddings."""
    seed: int = RUNNER.seed
    """Sampling seed of the workers."""
    execution: Execution = RUNNER.execution
    """eager: each step as it comes; graphs: one compiled graph per shape bucket, compiled
    at warm-up; auto: graphs on hpu and cuda, eager on cpu."""
    chat_template: Annotated[str | None, AfterValidator(_chat_template)] = None
    """Jinja chat template file (or the template itself) for chat requests, replacing the
    model's; null: the model's own. A base model has none: its chat requests get a 400."""
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    """How tool calls are read out of the model's text for tool_choice auto: hermes
    (<tool_call>{...}</tool_call>, Qwen / Hermes templates), llama3_json (a bare
    {"name", "parameters"} object); null: no parser, and tool_choice auto gets a 400."""


class KVCacheSettings(Settings):
    block_size: int = Field(RUNNER.block_size, ge=1)
    """Tokens per KV block."""
    memory_fraction: float = Field(RUNNER.kv_memory_fraction, gt=0, le=1)
    """Share of the memory free after loading the weights that the KV pool takes."""
    num_blocks: int | None = Field(None, ge=1)
    """A fixed pool size per decode worker instead of memory_fraction."""
    cpu_bytes: int = Field(RUNNER.cpu_kv_cache_bytes, ge=1)
    """Cap of the pool on CPU workers."""
    enable_prefix_caching: bool = CONTROLLER.decode.enable_prefix_caching
    """Keep computed full blocks named by their tokens, so a request whose prompt starts
    like an earlier one's reuses their KV and computes only the rest (every worker, both
    shapes); false: every prompt is computed whole."""


class ShapeRange(Settings):
    """[min, step, max] or [min, step, max, limit] of one shape dimension (or a mapping)."""

    min: int = Field(ge=0)
    step: int = Field(ge=1)
    max: int = Field(ge=0)
    limit: int | None = Field(None, ge=1)
    """Points of the exponential strategy (the linear one ignores it)."""

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, data: Any) -> Any:
        if not isinstance(data, list):
            return data
        if len(data) not in (3, 4):
            raise ValueError("must be [min, step, max] or [min, step, max, limit]")
        return dict(zip(("min", "step", "max", "limit"), data, strict=False))

    @model_validator(mode="after")
    def _ordered(self) -> ShapeRange:
        if self.max < self.min:
            raise SettingsError("max", f"must be >= min ({self.min}), got {self.max}")
        return self


class PromptShapes(Settings):
    """Prompt shape buckets `(batch, query, context blocks)`; a dimension left out takes
    the bucket manager's default."""

    bs: ShapeRange | None = None
    """Batch sizes."""
    query: ShapeRange | None = None
    """Query lengths (tokens)."""
    ctx: ShapeRange | None = None
    """Context blocks beside the query; null: every count that fits."""


class DecodeShapes(Settings):
    """Decode shape buckets `(batch, 1, blocks)`."""

    bs: ShapeRange | None = None
    """Batch sizes."""
    blocks: ShapeRange | None = None
    """KV blocks of the whole batch."""


class BucketsSettings(Settings):
    strategy: Literal["exponential", "linear", "file", "unified"] = "exponential"
    """Shape buckets: exponential, linear or file; unified: every decode-worker step (prompt
    chunks and decode rows together) pads to (query, shared blocks, unique blocks,
    is_causal) buckets from the engine's max_num_seqs, max_num_batched_tokens and pool."""
    file: str | None = None
    """The bucket file of the file strategy (or $BUCKETSERVE_BUCKET_FILE)."""
    prompt: PromptShapes | None = None
    """Prompt shape ranges; null: derived from the model (batch 1..16, query
    block_size..max_model_len, two per doubling)."""
    decode: DecodeShapes | None = None
    """Decode shape ranges; null: derived from the model (batch 1..max_num_seqs)."""
    theta: float = Field(REQUEST_BUCKETS.theta, gt=0, le=1)
    """θ: split a request bucket when more than this share of it lies below its middle."""
    max_len: int | None = Field(None, ge=2)
    """L_max: request buckets cover [0, L_max); sets model.max_model_len. null: the
    model's length."""
    max_buckets: int = Field(REQUEST_BUCKETS.max_buckets, ge=1)
    """Most request buckets."""
    batching: BatchingConfig = BatchingConfig()
    """Prefill batches: memory-safe size (Eq. 5-6) and token budget."""


class ClusterSettings(Settings):
    resources: dict[str, Annotated[float, Ge(0)]] = Field(default_factory=dict)
    """What the cluster has, summed over its nodes, e.g. {HPU: 16}: more workers than
    these can place is an error."""


class ServeSettings(Settings):
    """The whole file."""

    model: ModelSettings = ModelSettings()
    """The model, and how every worker runs it."""
    kv_cache: KVCacheSettings = KVCacheSettings()
    """Each worker's paged KV cache."""
    controller: ControllerConfig = ControllerConfig()
    """The deployment topology, the workers and how the controller looks after them."""
    buckets: BucketsSettings = BucketsSettings()
    """Shape buckets (the compiled shapes batches pad to) and request buckets (Algorithm 1:
    prompt-length ranges that split under load and merge when it drops)."""
    tenants: list[TenantConfig] | None = None
    """Who may call, by API key: a list of tenants (or a mapping by name). Without tenants
    every request is tenant `default` (online, fcfs, TTFT 4 s and TPOT 0.25 s targets) and
    needs no key; a lone tenant named `default` without keys sets its own targets and keeps
    the service open. Once other tenants are named, every request carries one of their
    keys (`authorization: Bearer <key>`)."""
    gateway: GatewayConfig = GatewayConfig()
    """The gRPC and OpenAI-compatible HTTP front ends."""
    cluster: ClusterSettings = ClusterSettings()
    """What the cluster has, checked without starting anything (serving checks the live
    cluster as well)."""

    @field_validator("tenants", mode="before")
    @classmethod
    def _tenants_by_name(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return [
            {"name": name, **(v or {})} if isinstance(v, dict) or v is None else v
            for name, v in data.items()
        ]

    @model_validator(mode="after")
    def _one_longest_request(self) -> ServeSettings:
        """L_max is the longest request served, so it sets the runner's max_model_len."""
        max_len, given = self.buckets.max_len, self.model.max_model_len
        if max_len is not None and given is not None and given != max_len:
            raise SettingsError(
                "buckets.max_len",
                f"L_max {max_len} differs from model.max_model_len {given}; both bound the "
                "longest request: give one of them (or equal values)",
            )
        return self
