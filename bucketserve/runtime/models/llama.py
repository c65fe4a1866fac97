"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, ...): the shared layers, wired as
Llama's config and checkpoint name them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bucketserve.runtime.attention.attend import Attend
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.layers.embedding import VocabEmbedding
from bucketserve.runtime.layers.layernorm import RMSNorm
from bucketserve.runtime.layers.mlp import GatedMLP
from bucketserve.runtime.layers.rotary_embedding import RotaryEmbedding
from bucketserve.runtime.layers.self_attention import SelfAttention
from bucketserve.runtime.models.causal_lm import CausalLM, DecoderModel
from bucketserve.runtime.models.family import GGUFField, GGUFLayout, ModelFamily

# checkpoint name fragment -> (our stacked parameter, shard index)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and gated MLP, each added to the residual stream. `qkv_bias`,
    `o_bias`: None follows `attention_bias`; `qk_norm`: per-head RMSNorms of q and k."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        qk_norm: bool = False,
    ) -> None:
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = SelfAttention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            qkv_bias=c.attention_bias if qkv_bias is None else qkv_bias,
            o_bias=c.attention_bias if o_bias is None else o_bias,
            qk_norm_eps=c.rms_norm_eps if qk_norm else None,
            sliding_window=c.layer_sliding_window(layer),
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act, c.mlp_bias)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        """The layer's output; `x`, the residual stream, is consumed (`Linear.add`)."""
        x = self.self_attn(self.input_layernorm(x), cos_sin, attend, x)
        return self.mlp(self.post_attention_layernorm(x), x)


class LlamaModel(DecoderModel):
    def __init__(
        self, config: ModelConfig, max_positions: int, layer_cls: type[LlamaDecoderLayer]
    ) -> None:
        super().__init__()
        c = config
        self.embed_tokens = VocabEmbedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layer_cls(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(c.head_dim, max_positions, c.rope_theta, c.rope_scaling)


class LlamaForCausalLM(CausalLM):
    """Llama's wiring; a family that differs only in its decoder layer (Qwen2, Qwen3)
    subclasses it with its own `layer_cls`."""

    stacked_params = STACKED_PARAMS
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config)
        positions = max_positions or config.max_position_embeddings
        self.model = LlamaModel(config, positions, self.layer_cls)
        self.lm_head = self.lm_head_for(self.model.embed_tokens)


def llama_fields(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Llama attends globally; Mistral with one window (`sliding_window`) in every layer."""
    layers = d["num_hidden_layers"]
    window = None if architecture == "LlamaForCausalLM" else d.get("sliding_window")
    return {
        "hidden_act": d.get("hidden_act", "silu"),
        "sliding_window": window,
        "layer_types": tuple(d.get("layer_types") or ["sliding_attention"] * layers),
    }


def gguf_config(field: GGUFField, common: dict[str, Any]) -> dict[str, Any]:
    """What a Llama-style GGUF leaves to its architecture's defaults."""
    return {"hidden_act": "silu", "rope_theta": field("rope.freq_base", 10000.0), "mlp_bias": False}


GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

FAMILY = ModelFamily(
    LlamaForCausalLM,
    ("LlamaForCausalLM", "MistralForCausalLM"),  # Mistral: Llama's wiring, a window
    llama_fields,
    model_type="llama",
    gguf=GGUFLayout("llama", GGUF_LAYER_NAMES, gguf_config, permuted_qk=True),  # also Mistral
)
