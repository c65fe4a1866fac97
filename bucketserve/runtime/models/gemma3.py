"""Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorms of `1 + weight` around both
blocks and over each head's q and k, a GeGLU MLP, interleaved sliding-window and global
layers with rope bases of their own, tied head with optional logit softcapping."""

from __future__ import annotations

import torch
from torch import nn

from bucketserve.runtime.attention.attend import Attend
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.layers.embedding import VocabEmbedding
from bucketserve.runtime.layers.layernorm import RMSNorm
from bucketserve.runtime.layers.mlp import GatedMLP
from bucketserve.runtime.layers.rotary_embedding import RotaryEmbeddings
from bucketserve.runtime.layers.self_attention import SelfAttention
from bucketserve.runtime.models.causal_lm import CausalLM, DecoderModel
from bucketserve.runtime.models.llama import STACKED_PARAMS

GLOBAL_ROPE, LOCAL_ROPE = 0, 1  # rows of the model's stacked rope tables


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        window = c.layer_sliding_window(layer)
        self.rope_table = GLOBAL_ROPE if window is None else LOCAL_ROPE
        self.self_attn = SelfAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            qkv_bias=c.attention_bias,
            o_bias=c.attention_bias,
            scale=c.query_pre_attn_scalar**-0.5,
            qk_norm_eps=c.rms_norm_eps,
            unit_offset=True,
            sliding_window=window,
        )
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            setattr(self, f"{name}_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, True))

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos_sin[self.rope_table], attend)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3Model(DecoderModel):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        c = config
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size, c.hidden_size**0.5)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, unit_offset=True)
        bases = [(c.rope_theta, c.rope_scaling), (c.rope_local_theta or c.rope_theta, None)]
        self.rotary_emb = RotaryEmbeddings(c.head_dim, max_positions, bases)


class Gemma3ForCausalLM(CausalLM):
    stacked_params = STACKED_PARAMS

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config)
        positions = max_positions or config.max_position_embeddings
        self.model = Gemma3Model(config, positions)
        self.lm_head = self.lm_head_for(self.model.embed_tokens, config.final_logit_softcapping)
