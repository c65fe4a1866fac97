"""What a model family declares beside its module: the Hugging Face architectures it serves,
how it reads their config.json, and how llama.cpp names and lays out its tensors in a GGUF.
`registry.FAMILIES` is the one list of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# (key, default) -> a GGUF metadata value of the file's architecture (`<arch>.<key>`)
GGUFField = Callable[..., Any]

GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class GGUFLayout:
    """A family's GGUF files. `arch`: their `general.architecture`; `layer_names`: llama.cpp's
    per-layer tensor names (`blk.N.<name>`) to the Hugging Face ones under
    `model.layers.N.`; `config`: config.json keys the family has beyond those every file
    gives (`GGUFConverter.config_dict`), from the file's metadata and those common keys;
    `permuted_qk`: llama.cpp's converter interleaved each head's two rotary halves of the q
    and k rows (undone at load); `unit_offset_norms`: norm weights stored as `1 + w`;
    `turn_end`: a token that ends a chat turn, a stop token though the file names only its
    eos."""

    arch: str
    layer_names: Mapping[str, str]
    config: Callable[[GGUFField, dict[str, Any]], dict[str, Any]]
    permuted_qk: bool = False
    unit_offset_norms: bool = False
    turn_end: str | None = None


@dataclass(frozen=True)
class ModelFamily:
    """`model`: the `CausalLM` class; `architectures`: the config.json `architectures`
    names it serves (the first is what a GGUF of the family converts to, with
    `model_type`); `config_fields(d, architecture)`: the `ModelConfig` fields the family
    reads its own way from config.json `d`, over those every family shares;
    `activations`: the `hidden_act` values its MLP runs; `gguf`: its GGUF layout, None
    where llama.cpp has no such files served here."""

    model: type
    architectures: tuple[str, ...]
    config_fields: Callable[[dict[str, Any], str], dict[str, Any]]
    model_type: str = ""
    activations: tuple[str, ...] = GATED_ACTIVATIONS
    gguf: GGUFLayout | None = field(default=None)
