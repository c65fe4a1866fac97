"""Qwen3 (dense): Llama's wiring with a per-head RMSNorm of q and of k before the rotary
embedding, and no biases unless the config asks."""

from __future__ import annotations

from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.models.family import GGUFLayout, ModelFamily
from bucketserve.runtime.models.llama import (
    GGUF_LAYER_NAMES,
    GGUF_QK_NORM_NAMES,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    gguf_config,
)
from bucketserve.runtime.models.qwen2 import qwen_fields


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer, qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer


FAMILY = ModelFamily(
    Qwen3ForCausalLM,
    ("Qwen3ForCausalLM",),
    qwen_fields,
    model_type="qwen3",
    gguf=GGUFLayout("qwen3", {**GGUF_LAYER_NAMES, **GGUF_QK_NORM_NAMES}, gguf_config),
)
