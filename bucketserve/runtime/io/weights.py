"""Find a model's Hugging Face directory (converting a GGUF once, cached) and read its weights."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from bucketserve.runtime.io.default_model import cache_root, default_gguf_path
from bucketserve.runtime.io.gguf_converter import GGUFConverter
from bucketserve.runtime.io.quantized import BLOCK_TYPES, QuantizedTensor

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


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint shards: from model.safetensors.index.json, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{model_dir} has no *.safetensors weights (.bin checkpoints are not supported)"
        )
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"checkpoint shards listed in the index are missing: {missing}")
    return files


def iter_safetensors(
    model_dir: str | Path,
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(name, tensor) for every weight of the checkpoint, one shard at a time; a weight
    the metadata lists in `block_types` (a GGUF converted with its blocks kept) as a
    `QuantizedTensor`."""
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            block_types = json.loads((f.metadata() or {}).get("block_types", "{}"))
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                tensor = f.get_tensor(name)
                kind = block_types.get(name)
                yield name, tensor if kind is None else QuantizedTensor(tensor, kind)
