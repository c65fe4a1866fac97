"""The service config file (`bucketserve/deploy/serve.yaml`) as pydantic models: one per
section, each key with its type, default and allowed values, and its docstring as its entry
in the key reference (`docs/configuration.md`, generated from these models).

`ServeConfig` (serve_config.py) builds the controller's, the gateway's and the bucket
manager's configs from a validated `ServeSettings`.
"""

from __future__ import annotations

from typing import Annotated, Any

from annotated_types import Ge
from pydantic import Field, field_validator, model_validator

from bucketserve.bucket_manager.config import (
    BatchingConfig,
    DecodeShapeConfig,
    PromptShapeConfig,
    RequestBucketConfig,
    ShapeBucketConfig,
    TenantConfig,
)
from bucketserve.controller.config import ControllerConfig
from bucketserve.gateway.gateway_config import GatewayConfig
from bucketserve.runtime.worker.runner_config import KVCacheSettings, ModelSettings
from bucketserve.utils.settings import Settings, SettingsError


class BucketsSettings(ShapeBucketConfig, RequestBucketConfig):
    """The `buckets` section: the shape buckets' keys and the request buckets' (each
    declared by its model), with the prompt and decode ranges derived from the model where
    the file leaves them out."""

    prompt: PromptShapeConfig | None = None
    """Prompt shape ranges; null: derived from the model (batch 1..16, query
    block_size..max_model_len, two per doubling)."""
    decode: DecodeShapeConfig | None = None
    """Decode shape ranges; null: derived from the model (batch 1..max_num_seqs)."""
    batching: BatchingConfig = BatchingConfig()
    """Prefill batches: memory-safe size (Eq. 5-6) and token budget."""

    def request_buckets(self) -> RequestBucketConfig:
        keys = RequestBucketConfig.model_fields
        return RequestBucketConfig(**{k: getattr(self, k) for k in keys})

    def shape_keys(self) -> dict[str, Any]:
        """The shape-bucket keys the file gives (the model derives the others)."""
        given = {k: getattr(self, k) for k in ("file", "prompt", "decode")}
        if "strategy" in self.model_fields_set:
            given["strategy"] = self.strategy
        return {k: v for k, v in given.items() if v is not None}


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
