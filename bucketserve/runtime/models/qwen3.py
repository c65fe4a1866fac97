"""Qwen3 (dense): Llama's wiring with a per-head RMSNorm of q and of k before the rotary
embedding, and no biases unless the config asks."""

from __future__ import annotations

from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer, qk_norm=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
