"""The served families, one list (`FAMILIES`), looked up by the config's `architectures`
name (vLLM's way) or a GGUF's `general.architecture`; parsing a config.json goes through
the family that serves it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bucketserve.runtime.io.model_config import ModelConfig, read_config_json
from bucketserve.runtime.models import gemma3, llama, opt, phi3, qwen2, qwen3
from bucketserve.runtime.models.causal_lm import CausalLM
from bucketserve.runtime.models.family import ModelFamily

FAMILIES: tuple[ModelFamily, ...] = (
    llama.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    gemma3.FAMILY,
    phi3.FAMILY,
    opt.FAMILY,
)
ARCHITECTURES = {a: f for f in FAMILIES for a in f.architectures}
GGUF_ARCHITECTURES = {f.gguf.arch: f for f in FAMILIES if f.gguf is not None}


def family(architecture: str) -> ModelFamily:
    """The family serving `architecture`; an unknown one names those that are served."""
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; "
            f"this runtime runs {', '.join(ARCHITECTURES)}"
        ) from None


def gguf_family(arch: str) -> ModelFamily:
    """The family whose GGUF files say `general.architecture` = `arch`."""
    try:
        return GGUF_ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {tuple(GGUF_ARCHITECTURES)}"
        ) from None


def model_class(architecture: str) -> type[CausalLM]:
    return family(architecture).model


def parse_model_config(d: dict[str, Any]) -> ModelConfig:
    """The `ModelConfig` of config.json `d`, read by the family of `architectures[0]`."""
    architecture = (d.get("architectures") or ["LlamaForCausalLM"])[0]
    fam = family(architecture)
    try:
        return ModelConfig.from_dict(
            d, architecture, fam.config_fields(d, architecture), fam.activations
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks the required field {e.args[0]!r}") from None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face model directory."""
    return parse_model_config(read_config_json(model_dir))
