"""Model implementations, looked up by the `architectures` name in config.json (vLLM's
way): one file per family, wiring the shared layers (`runtime/layers`)."""

from bucketserve.runtime.models.causal_lm import CausalLM
from bucketserve.runtime.models.gemma3 import Gemma3ForCausalLM
from bucketserve.runtime.models.llama import LlamaForCausalLM
from bucketserve.runtime.models.opt import OPTForCausalLM
from bucketserve.runtime.models.qwen2 import Qwen2ForCausalLM
from bucketserve.runtime.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama's wiring; its window is in the config
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    """The class serving `architecture`; an unknown one names those that are served."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"this runtime runs {', '.join(MODEL_REGISTRY)}"
        ) from None


__all__ = ["MODEL_REGISTRY", "CausalLM", "LlamaForCausalLM", "model_class"]
