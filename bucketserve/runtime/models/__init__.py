"""Model implementations, looked up by the `architectures` name in config.json."""

from bucketserve.runtime.models.llama import LlamaForCausalLM

MODEL_REGISTRY = {"LlamaForCausalLM": LlamaForCausalLM}

__all__ = ["MODEL_REGISTRY", "LlamaForCausalLM"]
