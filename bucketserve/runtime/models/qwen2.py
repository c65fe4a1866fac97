"""Qwen2 / Qwen2.5: Llama's wiring with biases on q, k and v (none on the output
projection); a sliding window from `max_window_layers` on where the config turns it on."""

from __future__ import annotations

from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen2DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer, qkv_bias=True, o_bias=False)


class Qwen2ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen2DecoderLayer
