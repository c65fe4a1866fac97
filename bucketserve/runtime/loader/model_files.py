"""A model's Hugging Face directory: as given, or a GGUF's conversion (cached, made once)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from bucketserve.runtime.io.default_model import cache_root, default_gguf_path
from bucketserve.runtime.io.quantized import BLOCK_TYPES
from bucketserve.runtime.loader.gguf_converter import GGUFConverter

CONVERTER_VERSION = "1"  # bump when conversion output changes, to invalidate caches


def resolve_model(model: str | os.PathLike | None = None, keep_blocks: bool = False) -> Path:
    """A HF model directory for `model`: None (the embedded default), a HF dir or a .gguf
    file (its weights in their quantized blocks where `keep_blocks` and the kernels take
    their type: `GGUFConverter.write`)."""
    if model is None:
        return convert_gguf(default_gguf_path(), keep_blocks=keep_blocks)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(
                f"{path} is a file but not a .gguf; pass a HF model dir or a .gguf file"
            )
        return convert_gguf(path, keep_blocks=keep_blocks)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json; pass a Hugging Face model directory")
    return path


def convert_gguf(
    gguf_path: str | Path, cache_dir: str | Path | None = None, keep_blocks: bool = False
) -> Path:
    """The cached HF conversion of `gguf_path`, converting (atomically) on first use."""
    gguf_path = Path(gguf_path)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    # a kept-blocks copy also depends on which types the kernels take
    kept = ",".join(BLOCK_TYPES) if keep_blocks else ""
    suffix = "-blocks" if keep_blocks else ""
    target = root / f"{gguf_path.stem}-{_content_hash(gguf_path, kept)}{suffix}"
    if (target / "config.json").is_file():
        return target
    converter = GGUFConverter(gguf_path)  # validates before any file is written
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    try:
        converter.write(tmp, keep_blocks=keep_blocks)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race with another converter
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _content_hash(path: Path, salt: str = "") -> str:
    digest = hashlib.sha256((CONVERTER_VERSION + salt).encode())
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:12]
