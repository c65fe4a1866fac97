"""Qwen2 / Qwen2.5: Llama's wiring with biases on q, k and v (none on the output
projection); a sliding window from `max_window_layers` on where the config turns it on."""

from __future__ import annotations

from typing import Any

from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.models.family import GGUFLayout, ModelFamily
from bucketserve.runtime.models.llama import (
    GGUF_LAYER_NAMES,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    gguf_config,
)


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer


def qwen_fields(d: dict[str, Any], architecture: str) -> dict[str, Any]:
    """A window from layer `max_window_layers` on, where `use_sliding_window` turns it on."""
    layers = d["num_hidden_layers"]
    first = d.get("max_window_layers", layers)
    default_types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return {
        "hidden_act": d.get("hidden_act", "silu"),
        "sliding_window": d.get("sliding_window") if d.get("use_sliding_window") else None,
        "layer_types": tuple(d.get("layer_types") or default_types),
    }


FAMILY = ModelFamily(
    Qwen2ForCausalLM,
    ("Qwen2ForCausalLM",),
    qwen_fields,
    model_type="qwen2",
    gguf=GGUFLayout("qwen2", GGUF_LAYER_NAMES, gguf_config),  # q/k/v biases; rows unpermuted
)
