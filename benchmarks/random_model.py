"""A seeded random-weight copy of a model directory, for machines that lack its weights.

Only `config.json` and the tokenizer files are read, so a directory holding just those
(a few MB) stands in for the 0.5 GB SmolLM2 safetensors where they cannot travel (a lent
GPU box). Same shapes, so the same compute per step; the tokens it generates mean nothing,
so a benchmark on it sets `ignore_eos`.

    python -m benchmarks.random_model --like ~/.cache/bucketserve/models/<dir> --out /tmp/m
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def random_model(like: Path, out: Path, seed: int = 0) -> Path:
    """Write a Llama with `like`'s config.json and tokenizer and seeded random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(like)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (like / name).is_file():
            shutil.copy(like / name, out / name)
    return out


def config_only(model_dir: Path, out: Path) -> Path:
    """Copy `model_dir`'s config.json and tokenizer files (no weights) into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", *TOKENIZER_FILES):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", required=True, help="a model dir (config.json + tokenizer)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config-only", action="store_true", help="copy config and tokenizer, write no weights"
    )
    args = parser.parse_args()
    like, out = Path(args.like), Path(args.out)
    path = config_only(like, out) if args.config_only else random_model(like, out, args.seed)
    print(path)


if __name__ == "__main__":
    main()
