"""Fixtures the runtime tests share."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gguf_reads import one_parse_per_gguf

# Every build of the C kernels CI proves: the native one, and on x86 the AVX2 + FMA one
# (x86-64-v3), which an AVX-512 CPU runs as well, so no ISA can silently stop compiling.
KERNEL_ISAS = ("native", "x86-64-v3") if platform.machine() == "x86_64" else ("native",)
LANES = {"x86-64-v3": 8}
SMALL_VOCAB = 320  # SmolLM2's specials, its byte alphabet and its first merged tokens


def use_kernels(isa: str, monkeypatch: pytest.MonkeyPatch):
    """The kernels built for `-march=isa`, loaded in place of the native build for the rest
    of the test. A build that fails here fails the test: the torch fallback is for users'
    odd machines, not a way for CI to stay green. Skipped only when switched off."""
    from bucketserve.runtime.cpu import kernels

    if os.environ.get(kernels.ENV_SWITCH) == "0":
        pytest.skip(f"{kernels.ENV_SWITCH}=0: the torch code runs")
    monkeypatch.setenv(kernels.ISA_ENV, isa)
    kernels.load.cache_clear()
    loaded = kernels.load()
    assert loaded is not None, f"the CPU kernels did not build for -march={isa} (log above)"
    assert loaded.isa == isa and loaded.lanes == LANES.get(isa, loaded.lanes)
    return loaded


@pytest.fixture(params=KERNEL_ISAS)
def kernel(request, monkeypatch) -> Iterator:
    """The C kernels of each ISA build (`KERNEL_ISAS`), asserted loaded."""
    from bucketserve.runtime.cpu import kernels

    yield use_kernels(request.param, monkeypatch)
    kernels.load.cache_clear()


@pytest.fixture(params=["onednn", "mkl", *(f"kernels-{isa}" for isa in KERNEL_ISAS)])
def gemm_backend(request, monkeypatch) -> Iterator[str]:
    """Eager CPU GEMMs through oneDNN, MKL's packed sgemm or the kernels' panel GEMM,
    whichever a machine measures fastest (`cpu_gemm_backend`, here pinned to one by
    narrowing GEMM_BACKENDS): all must give the same tokens. The kernels' GEMM runs once
    per ISA build, and so does everything else the kernels compute in that test
    (attention, norms, rotary)."""
    from bucketserve.runtime.cpu import gemm_plan, kernels, mkl_sgemm

    backend, _, isa = request.param.partition("-")
    if backend == "mkl" and not mkl_sgemm.available():
        pytest.skip("this torch build carries no MKL packed sgemm")
    if isa:
        use_kernels(isa, monkeypatch)
    monkeypatch.setattr(gemm_plan, "GEMM_BACKENDS", (backend,))
    gemm_plan.cpu_gemm_backend.cache_clear()
    yield backend
    gemm_plan.cpu_gemm_backend.cache_clear()
    kernels.load.cache_clear()


@pytest.fixture(scope="session")
def smollm_prompts(smollm_dir) -> list[list[int]]:
    """The latency demo's eight chat prompts on SmolLM2, as token ids."""
    from tests.runtime.smollm_chat import chat_prompts

    return chat_prompts(smollm_dir)


@pytest.fixture(scope="session")
def smollm_reference(smollm_dir, smollm_prompts):
    """transformers' greedy output for them, computed once for every test comparing with it."""
    from tests.runtime.smollm_chat import transformers_reference

    return transformers_reference(smollm_dir, smollm_prompts)


# -- GGUFs written here: SmolLM2's vocabulary and a conversion cache of their own ----------


@pytest.fixture(scope="module")
def smollm_gguf_reads() -> dict[str, Any]:
    """The parse of SmolLM2's GGUF, shared by the vocabulary below and transformers' loader."""
    return {}


@pytest.fixture(scope="module")
def vocab(smollm_gguf_reads) -> dict:
    from bucketserve.runtime.io.default_model import default_gguf_path
    from bucketserve.runtime.loader.gguf_converter import GGUFConverter

    with one_parse_per_gguf(smollm_gguf_reads):
        conv = GGUFConverter(default_gguf_path())
    keys = ("tokens", "merges", "token_type")
    return {k: conv.field(f"tokenizer.ggml.{k}") for k in keys} | {
        "template": conv.field("tokenizer.chat_template")
    }


@pytest.fixture(scope="module")
def small_vocab(vocab) -> dict:
    """The vocabulary's first SMALL_VOCAB tokens and the merges among them: for the tests
    that convert a GGUF without reading its text, as SmolLM2's ~150k vocabulary entries
    take the GGUF reader seconds to parse in every conversion."""
    tokens = vocab["tokens"][:SMALL_VOCAB]
    known = set(tokens)
    merges = [
        m for m in vocab["merges"]
        if all(part in known for part in m.split(" ", 1)) and m.replace(" ", "", 1) in known
    ]  # fmt: skip
    assert merges
    return {**vocab, "tokens": tokens, "token_type": vocab["token_type"][:SMALL_VOCAB],
            "merges": merges}  # fmt: skip


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    from bucketserve.runtime.cpu import kernels

    kernels.load()  # from the machine's cache: not compiled again into this empty one
    monkeypatch.setenv("BUCKETSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"
