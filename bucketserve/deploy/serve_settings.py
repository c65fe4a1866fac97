"""The service config file (`bucketserve/deploy/serve.yaml`) as pydantic models: one per
section, each key with its type, default and allowed values, and its docstring as its entry
in the key reference (`docs/configuration.md`, generated from these models).

`ServeConfig` (serve_config.py) builds the controller's, the gateway's and the bucket
manager's configs from a validated `ServeSettings`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from annotated_types import Ge
from pydantic import Field, field_validator, model_validator

from bucketserve.bucket_manager.config import (
    BatchingConfig,
    DecodeShapeConfig,
    PromptShapeConfig,
    RequestBucketConfig,
    TenantConfig,
)
from bucketserve.controller.config import ControllerConfig
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.runtime.worker.runner_config import KVCacheSettings, ModelSettings
from bucketserve.utils.settings import Settings, SettingsError

# The service's defaults are the configs' own: each default is written once, there.
REQUEST_BUCKETS = RequestBucketConfig()

class BucketsSettings(Settings):
    strategy: Literal["exponential", "linear", "file", "unified"] = "exponential"
    """Shape buckets: exponential, linear or file; unified: every decode-worker step (prompt
    chunks and decode rows together) pads to (query, shared blocks, unique blocks,
    is_causal) buckets from the engine's max_num_seqs, max_num_batched_tokens and pool."""
    file: str | None = None
    """The bucket file of the file strategy (or $BUCKETSERVE_BUCKET_FILE)."""
    prompt: PromptShapeConfig | None = None
    """Prompt shape ranges; null: derived from the model (batch 1..16, query
    block_size..max_model_len, two per doubling)."""
    decode: DecodeShapeConfig | None = None
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
