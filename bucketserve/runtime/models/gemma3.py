"""Gemma 3 (text): embeddings scaled by sqrt(hidden), RMSNorms of `1 + weight` around both
blocks and over each head's q and k, a GeGLU MLP, interleaved sliding-window and global
layers with rope bases of their own, tied head with optional logit softcapping."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bucketserve.runtime.attention.attend import Attend
from bucketserve.runtime.io.model_config import ModelConfig, RopeScaling
from bucketserve.runtime.layers.embedding import VocabEmbedding
from bucketserve.runtime.layers.layernorm import RMSNorm
from bucketserve.runtime.layers.mlp import GatedMLP
from bucketserve.runtime.layers.rotary_embedding import RotaryEmbeddings
from bucketserve.runtime.layers.self_attention import SelfAttention
from bucketserve.runtime.models.causal_lm import CausalLM, DecoderModel
from bucketserve.runtime.models.family import GGUFField, GGUFLayout, ModelFamily
from bucketserve.runtime.models.llama import GGUF_LAYER_NAMES, GGUF_QK_NORM_NAMES, STACKED_PARAMS

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


def gemma3_fields(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Interleaved sliding and global layers with rope bases of their own, either as
    transformers 4 writes them (`rope_local_base_freq`, `rope_scaling` for the global
    layers) or 5 (`rope_parameters` per layer type)."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 2 style attention)")
    if d.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: decoders are causal")
    layers = d["num_hidden_layers"]
    types = d.get("layer_types")
    if not types:
        pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    rope = d.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    local = rope.get("sliding_attention") or {}
    if RopeScaling.from_dict(local) is not None:
        raise ValueError("rope scaling on Gemma 3's sliding-window layers is not supported")
    heads = d["num_attention_heads"]
    return {
        "hidden_act": d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        "tie_word_embeddings": d.get("tie_word_embeddings", True),
        "sliding_window": d.get("sliding_window"),
        "layer_types": tuple(types),
        "rope_theta": float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
        "rope_scaling": RopeScaling.from_dict(d.get("rope_scaling") or full),
        "rope_local_theta": float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))),
        "query_pre_attn_scalar": float(
            d.get("query_pre_attn_scalar") or d.get("head_dim") or d["hidden_size"] // heads
        ),
        "final_logit_softcapping": d.get("final_logit_softcapping"),
    }


# What llama.cpp assumes for Gemma 3 files that do not say: every sixth layer attends
# globally, the sliding layers rotate with base 10000.
GGUF_SLIDING_PATTERN = 6
GGUF_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62  # the one size that scales queries by hidden / heads, not head_dim


def gguf_config(field: GGUFField, common: dict[str, Any]) -> dict[str, Any]:
    """The keys a Hugging Face Gemma 3 checkpoint's config.json has beyond Llama's."""
    layers, heads = common["num_hidden_layers"], common["num_attention_heads"]
    pattern = field("attention.sliding_window_pattern", GGUF_SLIDING_PATTERN)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    scalar = common["head_dim"]
    if layers == GEMMA3_27B_LAYERS:
        scalar = common["hidden_size"] // heads
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": field("rope.freq_base", 1_000_000.0),
        "rope_local_base_freq": field("rope.freq_base_swa", GGUF_LOCAL_ROPE_BASE),
        "sliding_window": field("attention.sliding_window"),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "query_pre_attn_scalar": scalar,
        "attn_logit_softcapping": field("attn_logit_softcapping", None),
        "final_logit_softcapping": field("final_logit_softcapping", None),
    }


# Gemma 3 norms the residual stream four times a layer; llama.cpp's ffn_norm is the one
# before the MLP.
GGUF_NAMES = {
    **GGUF_LAYER_NAMES,
    **GGUF_QK_NORM_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

FAMILY = ModelFamily(
    Gemma3ForCausalLM,
    ("Gemma3ForCausalLM",),
    gemma3_fields,
    model_type="gemma3_text",
    gguf=GGUFLayout(
        "gemma3", GGUF_NAMES, gguf_config, unit_offset_norms=True, turn_end="<end_of_turn>"
    ),
)
