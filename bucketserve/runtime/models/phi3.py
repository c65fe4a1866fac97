"""Phi-3 (mini, medium): Llama's wiring, every layer within `sliding_window` where the config
sets one; the checkpoint stores q, k, v as one `qkv_proj` and gate, up as one
`gate_up_proj` (in GGUF too), split into the shards the stacked parameters take."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from bucketserve.runtime.io.quantized import QuantizedTensor
from bucketserve.runtime.models.family import GGUFLayout, ModelFamily
from bucketserve.runtime.models.llama import GGUF_LAYER_NAMES, LlamaForCausalLM, gguf_config


class Phi3ForCausalLM(LlamaForCausalLM):
    def _our_names(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        parts = {
            ".qkv_proj.": {".q_proj.": q, ".k_proj.": kv, ".v_proj.": kv},
            ".gate_up_proj.": {
                ".gate_proj.": c.intermediate_size,
                ".up_proj.": c.intermediate_size,
            },
        }
        for name, tensor in super()._our_names(weights):
            fused = next((f for f in parts if f in name), None)
            if fused is None:
                yield name, tensor
                continue
            start = 0
            for part, rows in parts[fused].items():
                yield name.replace(fused, part), _rows(tensor, start, rows)
                start += rows


def _rows(
    tensor: torch.Tensor | QuantizedTensor, start: int, rows: int
) -> torch.Tensor | QuantizedTensor:
    if isinstance(tensor, QuantizedTensor):
        return QuantizedTensor(tensor.blocks[start : start + rows], tensor.block_type)
    return tensor[start : start + rows]


def phi3_fields(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    layers = d["num_hidden_layers"]
    rotary = (d.get("rope_parameters") or {}).get("partial_rotary_factor")
    if (rotary or d.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError("partial_rotary_factor below 1 is not supported (Phi-4-mini style)")
    return {
        "hidden_act": d.get("hidden_act", "silu"),
        "sliding_window": d.get("sliding_window"),
        "layer_types": ("sliding_attention",) * layers,
    }


FAMILY = ModelFamily(
    Phi3ForCausalLM,
    ("Phi3ForCausalLM",),
    phi3_fields,
    model_type="phi3",
    gguf=GGUFLayout(
        "phi3",
        {
            **GGUF_LAYER_NAMES,
            "attn_qkv": "self_attn.qkv_proj",
            "ffn_up": "mlp.gate_up_proj",  # gate and up, as the checkpoint
        },
        lambda field, common: {
            **gguf_config(field, common),
            "sliding_window": field("attention.sliding_window", None),
        },
    ),
)
