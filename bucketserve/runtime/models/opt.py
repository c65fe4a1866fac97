"""OPT: learned positions (offset 2), LayerNorm before (or, `do_layer_norm_before` false,
after) each block, a ReLU MLP, biases, embeddings narrower than the hidden size projected
in and out where `word_embed_proj_dim` says so, and a tied head. No rotary embedding."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from bucketserve.runtime.attention.attend import Attend
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.layers.embedding import LearnedPositions, VocabEmbedding
from bucketserve.runtime.layers.layernorm import LayerNorm
from bucketserve.runtime.layers.linear import Linear
from bucketserve.runtime.layers.mlp import MLP
from bucketserve.runtime.layers.self_attention import SelfAttention
from bucketserve.runtime.models.causal_lm import CausalLM, DecoderModel
from bucketserve.runtime.models.family import ModelFamily

POSITION_OFFSET = 2  # OPT's table starts its positions at row 2
# Hugging Face checkpoints name the decoder `model.decoder.` (facebook/opt-*: `decoder.`)
HF_PREFIXES = {"model.decoder.": "model.", "decoder.": "model."}
HF_RENAMES = {".fc1.": ".mlp.fc1.", ".fc2.": ".mlp.fc2.", ".out_proj.": ".o_proj."}
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
}


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, h = config, config.hidden_size
        heads = c.num_attention_heads
        self.pre_norm = c.do_layer_norm_before
        self.self_attn = SelfAttention(
            h, heads, heads, c.head_dim, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
            rope=False,
        )  # fmt: skip
        affine = c.layer_norm_elementwise_affine
        self.self_attn_layer_norm = LayerNorm(h, c.layer_norm_eps, affine)
        self.mlp = MLP(h, c.intermediate_size, c.mlp_bias)
        self.final_layer_norm = LayerNorm(h, c.layer_norm_eps, affine)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Each block adds to `x` (consumed), normed before it or, post-norm, after."""
        if self.pre_norm:
            x = self.self_attn(self.self_attn_layer_norm(x), rope, attend, x)
            return self.mlp(self.final_layer_norm(x), x)
        x = self.self_attn_layer_norm(self.self_attn(x, rope, attend, x))
        return self.final_layer_norm(self.mlp(x, x))


class OPTDecoder(DecoderModel):
    first_stage = ("embed_tokens", "embed_positions", "project_in")
    last_stage = ("final_layer_norm", "project_out")

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, h = config, config.hidden_size
        width = c.word_embed_proj_dim or h
        self.embed_tokens = VocabEmbedding(c.vocab_size, width)
        self.embed_positions = LearnedPositions(c.max_position_embeddings, h, POSITION_OFFSET)
        self.project_in = Linear(width, h) if width != h else None
        self.project_out = Linear(h, width) if width != h else None
        self.layers = nn.ModuleList(OPTDecoderLayer(c) for _ in range(c.num_hidden_layers))
        affine = c.layer_norm_elementwise_affine
        final = c.final_layer_norm
        self.final_layer_norm = LayerNorm(h, c.layer_norm_eps, affine) if final else None

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        return x + self.embed_positions(positions)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=positions.device)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        return x if self.project_out is None else self.project_out(x)


class OPTForCausalLM(CausalLM):
    hf_prefixes = HF_PREFIXES
    hf_renames = HF_RENAMES
    stacked_params = STACKED_PARAMS

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(config)
        self.model = OPTDecoder(config)
        self.lm_head = self.lm_head_for(self.model.embed_tokens)


def opt_fields(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """Learned positions, LayerNorm, a ReLU MLP, biases; no rotary embedding."""
    bias = d.get("enable_bias", True)
    pre_norm = d.get("do_layer_norm_before", True)
    heads = d["num_attention_heads"]
    return {
        "intermediate_size": d["ffn_dim"],
        "num_key_value_heads": heads,
        "head_dim": d["hidden_size"] // heads,
        "hidden_act": d.get("activation_function", "relu"),
        "tie_word_embeddings": d.get("tie_word_embeddings", True),
        "attention_bias": bias,
        "mlp_bias": bias,
        "rope_scaling": None,
        "sliding_window": None,
        "layer_types": (),
        "layer_norm_elementwise_affine": d.get("layer_norm_elementwise_affine", True),
        "do_layer_norm_before": pre_norm,
        "final_layer_norm": pre_norm and not d.get("_remove_final_layer_norm", False),
        "word_embed_proj_dim": d.get("word_embed_proj_dim") or d["hidden_size"],
    }


FAMILY = ModelFamily(
    OPTForCausalLM, ("OPTForCausalLM",), opt_fields, model_type="opt", activations=("relu",)
)
