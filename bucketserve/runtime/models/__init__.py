"""Model implementations: one file per family, wiring the shared layers (`runtime/layers`)
and declaring beside it how the family reads its config.json and GGUF files
(`family.ModelFamily`); `registry.FAMILIES` lists them."""

from bucketserve.runtime.models.causal_lm import CausalLM
from bucketserve.runtime.models.registry import (
    FAMILIES,
    load_model_config,
    model_class,
    parse_model_config,
)

__all__ = ["FAMILIES", "CausalLM", "load_model_config", "model_class", "parse_model_config"]
