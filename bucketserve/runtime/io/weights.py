"""Read a Hugging Face checkpoint's weights, shard by shard."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from bucketserve.runtime.io.quantized import QuantizedTensor


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
