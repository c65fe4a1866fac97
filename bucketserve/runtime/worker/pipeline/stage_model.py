"""One pipeline stage's slice of a model (any family in the registry): its layers, plus
the embedding on the first stage and the final norm + LM head on the last."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from bucketserve.runtime.attention.attend import KVLayers, paged_attend
from bucketserve.runtime.attention.metadata import AttentionMetadata
from bucketserve.runtime.distributed.tp_group import TPGroup
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.models import CausalLM, model_class
from bucketserve.runtime.worker.pipeline.stage_spec import StageSpec


class StageModel(nn.Module):
    """`forward` takes token ids (first stage) or the previous stage's hidden states and
    returns this stage's output: hidden states, normed on the last stage. Layer i of the
    stage reads and writes layer i of the stage's own KV pool. `model` and `lm_head` (last
    stage only) are the stage's parts of the whole model's, named alike."""

    def __init__(self, model: CausalLM, spec: StageSpec) -> None:
        super().__init__()
        self.model = model.model
        self.lm_head = getattr(model, "lm_head", None)
        self.spec = spec
        self.config = model.config
        self.num_kv_heads = model.num_kv_heads
        self.num_queries_per_kv = model.num_queries_per_kv

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        spec: StageSpec,
        weights: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int | None = None,
        tp: TPGroup | None = None,
    ) -> StageModel:
        """Allocate only this stage's parameters (with `tp`, this rank's shard of them),
        then fill them from the checkpoint."""
        model = model_class(config.architecture).build(
            config, weights, device, dtype, max_positions, layers=spec.layers, tp=tp
        )
        return cls(model, spec)

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor | None,
        positions: torch.Tensor,
        kv_cache: KVLayers,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        inner = self.model
        assert self.spec.is_first or hidden is not None, (
            "a stage after the first needs the previous stage's hidden states"
        )
        # the layers consume their input: the stage's own copy, never the caller's (a
        # tensor from Ray's object store is read-only)
        x = inner.embed(input_ids, positions) if self.spec.is_first else hidden.clone()
        metadata.prepare(self.num_queries_per_kv, self.config.head_dim, x.dtype)
        rope = inner.rope(positions, x.dtype)
        for i, layer in enumerate(inner.layers):
            x = layer(x, rope, paged_attend(*kv_cache.layer(i), metadata))
        return inner.final_norm(x) if self.spec.is_last else x

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, rows)

