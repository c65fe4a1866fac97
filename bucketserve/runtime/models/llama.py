"""Llama-family decoder (Llama 2/3, SmolLM2, ...): the shared layers, wired as Llama's
config and checkpoint name them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from bucketserve.runtime.attention.metadata import AttentionMetadata
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.layers.attention import Attend, KVLayers, paged_attend
from bucketserve.runtime.layers.layernorm import RMSNorm
from bucketserve.runtime.layers.linear import Linear
from bucketserve.runtime.layers.lm_head import LMHead
from bucketserve.runtime.layers.mlp import GatedMLP
from bucketserve.runtime.layers.rotary_embedding import RotaryEmbedding, apply_rope
from bucketserve.runtime.models.weight_loader import load_weights

# checkpoint name fragment -> (our stacked parameter, shard index)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = Linear(config.hidden_size, sizes, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, cos_sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """`residual + attention(x)`; `attend` writes K/V to the cache and attends."""
        tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = apply_rope(qk.view(tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v, self.scale)
        return self.o_proj.add(out.reshape(tokens, self.q_size), residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The layer's output; `x`, the residual stream, is consumed (`Linear.add`)."""
        x = self.self_attn(self.input_layernorm(x), x, cos_sin, attend)
        return self.mlp(self.post_attention_layernorm(x), x)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )


class LlamaForCausalLM(nn.Module):
    """`forward` maps a flat step (`input_ids [T]`, `positions [T]`) to hidden states
    `[T, hidden]`, writing each layer's K/V into the pool on the way;
    `compute_logits` projects only the rows that are sampled."""

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, tied)

    @classmethod
    def build(
        cls,
        config: ModelConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype,
        max_positions: int | None = None,
    ) -> LlamaForCausalLM:
        """Allocate without random init, then fill from `weights` (HF names)."""
        with torch.device("meta"):
            model = cls(config, max_positions)
        model = model.to_empty(device=device).to(dtype)
        model.model.rotary_emb.reset()
        model.load_weights(weights)
        return model.eval().requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVLayers,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        metadata.prepare(self.config.num_queries_per_kv, self.config.head_dim, x.dtype)
        cos_sin = self.model.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos_sin, paged_attend(*kv_cache.layer(i), metadata))
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits `[len(rows), vocab]` for the given token rows of `hidden`."""
        return self.lm_head(hidden, rows)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, stacking q/k/v and gate/up; all must be
        covered."""
        skip = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        load_weights(self, weights, STACKED_PARAMS, skip)
