"""The service config file (`bucketserve/deploy/serve.yaml`) as pydantic models: one per
section, each key with its type, default and allowed values, and its docstring as its entry
in the key reference (`docs/configuration.md`, generated from these models).

`ServeConfig` (serve_config.py) builds the controller's, the gateway's and the bucket
manager's configs from a validated `ServeSettings`.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from annotated_types import Ge
from pydantic import AfterValidator, Field, field_validator, model_validator

from bucketserve.bucket_manager.config import BatchingConfig, RequestBucketConfig, TenantConfig
from bucketserve.controller.config import ControllerConfig, Execution, PlacementConfig
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.utils.settings import Settings, SettingsError

logger = logging.getLogger(__name__)

# The service's defaults are the configs' own: each default is written once, there.
CONTROLLER, BATCHING, REQUEST_BUCKETS = ControllerConfig(), BatchingConfig(), RequestBucketConfig()
RUNNER, SERVING_SCHEDULER = CONTROLLER.runner, CONTROLLER.scheduler

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
    enable_prefix_caching: bool = SERVING_SCHEDULER.enable_prefix_caching
    """Keep computed full blocks named by their tokens, so a request whose prompt starts
    like an earlier one's reuses their KV and computes only the rest (every worker, both
    shapes); false: every prompt is computed whole."""


class PlacementSettings(PlacementConfig):
    """How many workers of one role, and where their Ray actors go."""

    num_workers: int = Field(1, ge=1)
    """Workers of this role (the colocated topology starts no prefill workers)."""


class PrefillSettings(PlacementSettings):
    kv_blocks: int | None = Field(None, ge=1)
    """Prefill pool size; null: as kv_cache. It holds batches until their handoff."""
    max_batches: int = Field(CONTROLLER.max_batches_per_prefill, ge=1)
    """Batches in flight at one prefill worker."""


class DecodeSettings(PlacementSettings):
    pipeline_depth: int = Field(CONTROLLER.pipeline_depth, ge=1)
    """Microbatches in flight (1: synchronous schedule / submit / finish / update)."""
    pace: float | None = Field(None, gt=0, le=1)
    """Disaggregated, prefill on the same cores: while a prefill batch for the worker runs,
    a step waits until a request would get its next token later than this fraction of its
    TPOT target (e.g. 0.8); null: never waits."""
    max_num_seqs: int = Field(SERVING_SCHEDULER.max_num_seqs, ge=1)
    """Sequences in one decode batch."""
    max_num_batched_tokens: int = Field(SERVING_SCHEDULER.max_num_batched_tokens, ge=1)
    """Tokens of one engine step."""
    enable_chunked_prefill: bool = SERVING_SCHEDULER.enable_chunked_prefill
    """Prefill a long prompt over several steps (the colocated topology, and recomputing a
    preempted sequence)."""
    long_prefill_token_threshold: int = Field(SERVING_SCHEDULER.long_prefill_token_threshold, ge=0)
    """A prompt with more tokens than this left to compute is long: it computes at most
    this many a step, so a short prompt arriving meanwhile waits for a chunk, not the
    whole prompt (vLLM's knob, off there by default); 0: off, as in the offline `LLM`."""
    max_long_partial_prefills: int = Field(SERVING_SCHEDULER.max_long_partial_prefills, ge=1)
    """Long prompts in progress at once; the next starts when one has its first token,
    while shorter prompts start beside them."""
    watermark: float = Field(SERVING_SCHEDULER.watermark, ge=0, lt=1)
    """Share of the KV blocks kept free before admitting more."""
    scheduling_policy: Literal["fcfs", "priority"] = SERVING_SCHEDULER.scheduling_policy
    """fcfs, or priority: by tenant priority, then request priority."""
    slo_admission: bool = SERVING_SCHEDULER.slo_admission
    """A new prompt waits while its prefill would cost a running request its TPOT target,
    and one past its TTFT deadline yields to those on time it would make late; false:
    plain queue order, as vLLM's."""
    late_yield_s: float | None = Field(SERVING_SCHEDULER.late_yield_s, gt=0)
    """Seconds past its TTFT deadline a prompt yields (and is held for running TPOTs)
    before it takes its place back; null: no bound."""


class ControllerSettings(Settings):
    topology: Literal["disaggregated", "colocated"] = CONTROLLER.topology
    """disaggregated: prefill workers hand KV to decode workers (separate cards);
    colocated: no prefill workers, each decode worker prefills in chunks within its steps
    (one machine or one card). Named `shape` before: that key is read, with a warning,
    until 0.2."""
    remote_prefill: Literal["auto", "always", "never"] = CONTROLLER.remote_prefill
    """disaggregated: auto sends each request to a prefill worker or lets its decode worker
    prefill it, whichever is cheaper now (its uncached tokens, each side's queue, the
    decode worker's running requests, the KV transfer); always: every prompt on a prefill
    worker; never: none (the decode workers prefill, as colocated)."""
    mode: Literal["ray", "local"] = CONTROLLER.mode
    """ray: workers are Ray actors; local: threads in this process."""
    ray_address: str | None = CONTROLLER.ray_address
    """null: start a local Ray; auto: join the running cluster; or host:port."""
    transport: Literal["auto", "ray", "collective", "inprocess"] = CONTROLLER.transport
    """KV transport: ray (object store), collective (NCCL / HCCL), inprocess (mode local),
    or auto."""
    max_restarts: int = Field(CONTROLLER.max_restarts, ge=-1)
    """Restarts of a dead worker actor (-1: forever)."""
    lease_ttl_s: float = Field(CONTROLLER.lease_ttl_s, gt=0)
    """Blocks held for a handoff are freed if not acknowledged within this."""
    worker_timeout_s: float = Field(CONTROLLER.worker_timeout_s, gt=0)
    """A worker call or decode step taking longer is hung: the worker is restarted."""
    max_queued_requests: int = Field(CONTROLLER.max_queued_requests, ge=1)
    """Requests waiting in the bucket manager before new ones are refused."""
    max_requeues: int = Field(CONTROLLER.max_requeues, ge=0)
    """Re-prefills of a request whose decode worker died."""
    stats_interval_s: float = Field(CONTROLLER.stats_interval_s, gt=0)
    """How often workers report their statistics."""
    placement_timeout_s: float = Field(CONTROLLER.placement_timeout_s, gt=0)
    """How long to wait for Ray to place the workers (an autoscaler adds nodes); then serve
    with those placed."""
    pad_to_shape_buckets: Literal["auto"] | bool = CONTROLLER.pad_to_shape_buckets
    """Pad batches to shape buckets: auto (on hpu and cuda, not on CPU), true or false."""
    warmup: Literal["auto", "all", "smallest", "none"] = CONTROLLER.warmup
    """Which shape buckets to compile at start (auto: all when padding, else the
    smallest)."""
    prefill: PrefillSettings = PrefillSettings()
    """The prefill workers (the disaggregated topology starts them) and where they go."""
    decode: DecodeSettings = DecodeSettings()
    """The decode workers, their continuous-batching engines and where they go."""

    @model_validator(mode="before")
    @classmethod
    def _shape_is_topology(cls, data: Any) -> Any:
        """`shape`, the key's old name: read as `topology`, with a warning, until 0.2."""
        if not isinstance(data, dict) or "shape" not in data:
            return data
        if "topology" in data:
            raise SettingsError(
                "shape", "is the old name of controller.topology: give only topology"
            )
        logger.warning(
            "controller.shape is deprecated: write controller.topology (shape is read until 0.2)"
        )
        data = dict(data)
        data["topology"] = data.pop("shape")
        return data

    @model_validator(mode="after")
    def _local_has_no_ray(self) -> ControllerSettings:
        if self.mode == "local" and self.ray_address is not None:
            raise SettingsError(
                "ray_address",
                "mode 'local' runs every worker in this process without Ray; remove "
                "ray_address or set controller.mode to 'ray'",
            )
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self) -> ControllerSettings:
        roles = ("decode",) if self.topology == "colocated" else ("prefill", "decode")
        for role in roles:
            settings = getattr(self, role)
            tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
            if tp > 1 and self.topology == "disaggregated" and pp > 1:
                raise SettingsError(
                    f"{role}.tensor_parallel_size",
                    f"tensor_parallel_size {tp} with pipeline_parallel_size {pp} in the "
                    "disaggregated topology: stage groups hand KV over through their heads, "
                    "which hold only rank 0's KV heads; set one of them to 1 or use "
                    "controller.topology: colocated",
                )
            if tp > 1 and self.topology == "disaggregated" and self.mode == "local":
                raise SettingsError(
                    f"{role}.tensor_parallel_size",
                    f"tensor_parallel_size {tp} in the disaggregated topology needs "
                    "controller.mode: ray (in local mode a worker's ranks are its child "
                    "processes, which no KV transport reaches)",
                )
        prefill, decode = self.prefill.tensor_parallel_size, self.decode.tensor_parallel_size
        if self.topology == "disaggregated" and prefill != decode:
            raise SettingsError(
                "decode.tensor_parallel_size",
                f"controller.prefill.tensor_parallel_size {prefill} and "
                f"controller.decode.tensor_parallel_size {decode} differ: each prefill rank "
                "hands its KV heads to the decode rank of the same index, so set both to "
                f"{prefill} or both to {decode} (or use controller.topology: colocated)",
            )
        return self


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


class BatchingSettings(Settings):
    safety_fraction: float = Field(BATCHING.safety_fraction, gt=0, le=1)
    """A prefill batch fits this share of the decode pool's free blocks (Eq. 5-6)."""
    max_num_seqs: int = Field(BATCHING.max_num_seqs, ge=1)
    """Requests in one prefill batch (padded: also at most the largest prompt bs)."""
    max_batched_tokens: int | None = Field(BATCHING.max_batched_tokens, ge=1)
    """Prompt tokens per prefill batch (a longer prompt goes alone): how long a request can
    wait behind one; raise it for offline work. null: no bound."""


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
    batching: BatchingSettings = BatchingSettings()
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
    controller: ControllerSettings = ControllerSettings()
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
