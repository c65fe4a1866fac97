"""What a model runner is built from: the config file's `model` and `kv_cache` sections, a
model each, and `ModelRunnerConfig`, the two together (torch-free)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from bucketserve.utils.settings import Settings

DEVICES = ("auto", "cpu", "cuda", "cuda:<i>", "hpu")
Execution = Literal["auto", "eager", "graphs"]


def _device(device: str) -> str:
    name = device.strip().lower()
    if name in ("auto", "cpu", "cuda", "hpu") or re.fullmatch(r"cuda:\d+", name):
        return device
    raise ValueError(f"must be one of {list(DEVICES)}; got {device!r}")


def _chat_template(template: str | None) -> str | None:
    if template is None or "{{" in template or "{%" in template:
        return template
    if not Path(template).expanduser().is_file():
        raise ValueError(f"{template} is not a file (nor a Jinja template)")
    return template


class ModelSettings(Settings):
    """The model, and how every worker runs it."""

    model: str | None = Field(None, alias="path")
    """HF model directory or .gguf file (on the head node); null: the embedded
    SmolLM2-135M-Instruct."""
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half"] = (
        "auto"
    )
    """auto: float32 on CPU, bfloat16 on cuda and hpu."""
    quantization: Literal["auto", "none"] = "auto"
    """auto: a GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q6_K weights stay in their
    blocks on CPU workers (eager, float32, no tensor parallelism), other types expanded to
    float32; none: every weight expanded to float32."""
    device: Annotated[str, AfterValidator(_device)] = "auto"
    """auto, cpu, cuda, cuda:<i> or hpu, as each worker sees it."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + output; null: the model's max_position_embeddings."""
    seed: int = 0
    """Sampling seed of the workers."""
    execution: Execution = "auto"
    """eager: each step as it comes; graphs: one compiled graph per shape bucket, compiled
    at warm-up; auto: graphs on hpu and cuda, eager on cpu."""
    chat_template: Annotated[str | None, AfterValidator(_chat_template)] = None
    """Jinja chat template file (or the template itself) for chat requests, replacing the
    model's; null: the model's own. A base model has none: its chat requests get a 400."""
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    """How tool calls are read out of the model's text for tool_choice auto: hermes
    (<tool_call>{...}</tool_call>, Qwen / Hermes templates), llama3_json (a bare
    {"name", "parameters"} object); null: no parser, and tool_choice auto gets a 400."""


class KVCacheSettings(Settings):
    """Each worker's paged KV cache."""

    block_size: int = Field(16, ge=1)
    """Tokens per KV block."""
    kv_memory_fraction: float = Field(0.8, gt=0, le=1, alias="memory_fraction")
    """Share of the memory free after loading the weights that the KV pool takes."""
    num_kv_blocks: int | None = Field(None, ge=1, alias="num_blocks")
    """A fixed pool size per decode worker instead of memory_fraction."""
    cpu_kv_cache_bytes: int = Field(1 << 30, ge=1, alias="cpu_bytes")
    """Cap of the pool on CPU workers."""
    enable_prefix_caching: bool = True
    """Keep computed full blocks named by their tokens, so a request whose prompt starts
    like an earlier one's reuses their KV and computes only the rest (every worker, both
    shapes); false: every prompt is computed whole."""


class ModelRunnerConfig(ModelSettings, KVCacheSettings):
    """A runner's model and KV pool. The pool holds `num_kv_blocks` blocks if given, else
    `kv_memory_fraction` of the memory free after loading the model (on CPU at most
    `cpu_kv_cache_bytes`). Padding costs more on CPU than a compiled graph saves, hence
    eager there. Once unified shapes `(tokens, shared blocks, unique blocks, is_causal)`
    are warmed in graphs mode, every step runs as one, prompt chunks and decode rows
    together. `chat_template` holds the template's text here; `tool_call_parser` travels
    to the gateway with the model's info."""
