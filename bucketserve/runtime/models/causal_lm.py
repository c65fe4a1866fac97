"""What every family shares: the decoder contract the runner drives, building on the meta
device and filling from a checkpoint (the whole model or one pipeline stage's layers), a
step's forward over the paged KV cache, and the logits of the sampled rows."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import ClassVar

import torch
from torch import nn

from bucketserve.runtime.attention.attend import KVLayers, paged_attend
from bucketserve.runtime.attention.metadata import AttentionMetadata
from bucketserve.runtime.distributed.tp_group import TPGroup, building, current
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.layers.embedding import VocabEmbedding
from bucketserve.runtime.layers.lm_head import LMHead
from bucketserve.runtime.layers.rotary_embedding import RotaryEmbedding
from bucketserve.runtime.models.weight_loader import StackedParams, load_weights

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DecoderModel(nn.Module):
    """The decoder stack as the runner drives it (eager steps, the graph regions, pipeline
    stages): `embed(input_ids, positions)`, `rope(positions, dtype)` (what every layer
    takes beside the hidden states), `layers` (each `layer(x, rope, attend)`, consuming
    `x`), `final_norm(x)`. The defaults read Llama's module names; `first_stage` and
    `last_stage` name the modules only the first / last pipeline stage holds."""

    first_stage: ClassVar[tuple[str, ...]] = ("embed_tokens",)
    last_stage: ClassVar[tuple[str, ...]] = ("norm",)
    layers: nn.ModuleList

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.rotary_emb(positions, dtype)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


class CausalLM(nn.Module):
    """`forward` maps a flat step (`input_ids [T]`, `positions [T]`) to hidden states
    `[T, hidden]`, writing each layer's K/V into the pool on the way; `compute_logits`
    projects only the rows that are sampled.

    A family's `__init__(config, max_positions)` sets `model` (its `DecoderModel`) and
    `lm_head`, and its class says how checkpoint names map onto its parameters:
    `hf_prefixes` (leading parts renamed), `hf_renames` (parts renamed anywhere), then
    `stacked_params` (tensors stacked into one parameter, as q, k, v into `qkv_proj`).

    Built with a tensor-parallel group (`tp`), every layer holds this rank's shard and
    `num_kv_heads`, `num_queries_per_kv` are the rank's (what its KV pool and attention
    hold)."""

    hf_prefixes: ClassVar[Mapping[str, str]] = {}
    hf_renames: ClassVar[Mapping[str, str]] = {}
    stacked_params: ClassVar[StackedParams] = {}
    model: DecoderModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.stage_layers: range | None = None  # set when built as one pipeline stage
        self.tp = tp = current()
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if tp is not None:
            check_tensor_parallel(config, tp.size)
            heads, kv = heads // tp.size, max(1, kv // tp.size)
        self.num_kv_heads = kv
        self.num_queries_per_kv = heads // kv

    def lm_head_for(self, embed_tokens: VocabEmbedding, softcap: float | None = None) -> LMHead:
        """The head over the embedding table when the checkpoint ties them, else its own."""
        c = self.config
        tied = embed_tokens if c.tie_word_embeddings else None
        return LMHead(embed_tokens.embedding_dim, c.vocab_size, tied, softcap)

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int | None = None,
        layers: range | None = None,
        tp: TPGroup | None = None,
    ) -> CausalLM:
        """Allocate without random init, then fill from `weights` (HF names). `layers`: only
        those decoder layers (renumbered from 0), with the embedding where the range starts
        at 0 and the final norm and head where it ends at the last layer. `tp`: this rank's
        shard of every layer."""
        with torch.device("meta"), building(tp):
            model = cls(config, max_positions)
        if layers is not None:
            model._keep_stage(layers)
        model = model.to_empty(device=device).to(dtype)
        for module in model.modules():
            if isinstance(module, (RotaryEmbedding, VocabEmbedding)):
                module.reset()
        model.load_weights(weights)
        return model.eval().requires_grad_(False)

    def _keep_stage(self, layers: range) -> None:
        inner, c = self.model, self.config
        first, last = layers.start == 0, layers.stop == c.num_hidden_layers
        self.stage_layers = layers
        inner.layers = nn.ModuleList(inner.layers[i] for i in layers)
        for name in inner.first_stage:
            tied_table = name == "embed_tokens" and last and c.tie_word_embeddings
            if not (first or tied_table):
                setattr(inner, name, None)
        if not last:
            for name in inner.last_stage:
                setattr(inner, name, None)
            del self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVLayers,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        inner = self.model
        x = inner.embed(input_ids, positions)
        metadata.prepare(self.num_queries_per_kv, self.config.head_dim, x.dtype)
        rope = inner.rope(positions, x.dtype)
        for i, layer in enumerate(inner.layers):
            x = layer(x, rope, paged_attend(*kv_cache.layer(i), metadata))
        return inner.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits `[len(rows), vocab]` for the given token rows of `hidden`."""
        return self.lm_head(hidden, rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (renamed, stacked); all must be covered. Built
        as a stage, tensors of other stages are passed over."""
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        load_weights(self, self._our_names(weights), self.stacked_params, skip)

    def _our_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        stage = self.stage_layers
        names = {n for n, _ in self.named_parameters()} if stage is not None else set()
        for name, tensor in weights:
            for old, new in self.hf_prefixes.items():
                if name.startswith(old):
                    name = new + name[len(old) :]
                    break
            for old, new in self.hf_renames.items():
                name = name.replace(old, new)
            if stage is not None:
                match = _LAYER.match(name)
                if match:
                    layer = int(match.group(1))
                    if layer not in stage:
                        continue
                    name = name.replace(f"layers.{layer}.", f"layers.{layer - stage.start}.", 1)
                elif name not in names:
                    continue  # the embedding, final norm or head of another stage
            yield name, tensor


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Whether `config`'s model splits over `size` ranks: attention heads and MLP units
    evenly, KV heads evenly or (fewer than the ranks) replicated onto equal blocks of them."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads {heads}")
    if kv % size and size % kv:
        problems.append(f"num_key_value_heads {kv} (neither divides the other)")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size {config.intermediate_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not split this model: " + ", ".join(problems)
        )
