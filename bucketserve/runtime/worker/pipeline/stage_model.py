"""One pipeline stage's slice of a Llama-family model: its layers, plus the embedding on
the first stage and the final norm + LM head on the last."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from bucketserve.runtime.attention.metadata import AttentionMetadata
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.layers.attention import KVLayers, paged_attend
from bucketserve.runtime.models.llama import LlamaForCausalLM
from bucketserve.runtime.worker.pipeline.stage_spec import StageSpec

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class StageModel(nn.Module):
    """`forward` takes token ids (first stage) or the previous stage's hidden states and
    returns this stage's output: hidden states, normed on the last stage. Layer i of the
    stage reads and writes layer i of the stage's own KV pool. `model` and `lm_head` (last
    stage only) are the stage's parts of the whole model's, named alike."""

    def __init__(self, model: LlamaForCausalLM, spec: StageSpec) -> None:
        super().__init__()
        self.model = model.model
        self.lm_head = getattr(model, "lm_head", None)
        self.spec = spec
        self.config = model.config

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        spec: StageSpec,
        weights: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int | None = None,
    ) -> StageModel:
        """Allocate only this stage's parameters, then fill them from the checkpoint."""
        with torch.device("meta"):
            model = LlamaForCausalLM(config, max_positions)
        inner = model.model
        inner.layers = nn.ModuleList(inner.layers[i] for i in spec.layers)
        tied_head = spec.is_last and config.tie_word_embeddings
        if not (spec.is_first or tied_head):
            inner.embed_tokens = None
        if not spec.is_last:
            inner.norm = None
            if hasattr(model, "lm_head"):
                del model.lm_head
        model = model.to_empty(device=device).to(dtype)
        inner.rotary_emb.reset()
        model.load_weights(_stage_weights(weights, spec, config, model))
        return cls(model.eval().requires_grad_(False), spec)

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
        x = inner.embed_tokens(input_ids) if self.spec.is_first else hidden.clone()
        metadata.prepare(self.config.num_queries_per_kv, self.config.head_dim, x.dtype)
        cos_sin = inner.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(inner.layers):
            x = layer(x, cos_sin, paged_attend(*kv_cache.layer(i), metadata))
        return inner.norm(x) if self.spec.is_last else x

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, rows)


def _stage_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    spec: StageSpec,
    config: ModelConfig,
    model: nn.Module,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors this stage holds, its layers renumbered from 0."""
    names = {n for n, _ in model.named_parameters()}
    for name, tensor in weights:
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            if layer in spec.layers:
                yield name.replace(f"layers.{layer}.", f"layers.{layer - spec.start}.", 1), tensor
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # load_weights skips it too
        elif name in names or "rotary_emb" in name:
            yield name, tensor
