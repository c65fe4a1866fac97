"""`bucketserve buckets`: print the shape buckets that warm-up would compile, before starting."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from bucketserve.bucket_manager.bucket_file import BucketFileError
from bucketserve.bucket_manager.config import (
    BUCKET_FILE_ENV,
    STRATEGIES,
    BucketRange,
    ShapeBucketConfig,
)
from bucketserve.bucket_manager.shape_buckets import ShapeBuckets
from bucketserve.runtime.core.scheduler import SchedulerConfig

_RANGE_FLAGS = {
    "prompt_bs": ("--prompt-bs", "prompt", "bs"),
    "prompt_seq": ("--prompt-seq", "prompt", "query"),
    "prompt_ctx": ("--prompt-ctx", "prompt", "ctx"),
    "decode_bs": ("--decode-bs", "decode", "bs"),
    "decode_block": ("--decode-block", "decode", "blocks"),
}
_ENGINE_FLAGS = {  # the unified strategy's sizes
    "max_num_seqs": ("--max-num-seqs", "sequences in one engine step"),
    "max_num_batched_tokens": ("--max-num-batched-tokens", "tokens in one engine step"),
    "num_blocks": ("--num-blocks", "blocks in the KV pool"),
}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "buckets",
        help="print the shape buckets (prompt, decode; unified) a configuration generates",
        description=(
            "Print the shape-bucket configuration and the generated prompt and decode buckets "
            "in the warm-up log format. Flags override the config file. The 'file' strategy "
            f"reads --file, the config's `file`, or ${BUCKET_FILE_ENV}. The 'unified' "
            "strategy also prints the (query, shared blocks, unique blocks, is_causal) "
            "buckets every engine step pads to, from --max-num-seqs, "
            "--max-num-batched-tokens and --num-blocks (a service YAML: its decode engine's "
            "limits and kv_cache.num_blocks)."
        ),
    )
    parser.add_argument("--config", type=Path, help="service YAML (its `shape_buckets` section)")
    parser.add_argument("--strategy", choices=STRATEGIES)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--file", help="bucket file for the 'file' strategy")
    for dest, (flag, what) in _ENGINE_FLAGS.items():
        parser.add_argument(flag, dest=dest, type=int, metavar="N", help=f"unified: {what}")
    for dest, (flag, phase, dim) in _RANGE_FLAGS.items():
        parser.add_argument(
            flag,
            dest=dest,
            type=int,
            nargs="+",
            metavar="N",
            help=f"{phase} {dim}: MIN STEP MAX [LIMIT]",
        )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = build_config(args)
        shapes = ShapeBuckets(config, log=False)
    except (ValueError, BucketFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(shapes.describe()))
    if shapes.unified:
        print(
            f"Unified buckets shown for a pool of {config.num_blocks} blocks: a decode worker "
            "sizes them for its engine's limits and its own KV pool",
            file=sys.stderr,
        )
    per_seq = -(-config.max_model_len // config.block_size)
    reachable = [b for b in shapes.decode if b[2] <= b[0] * per_seq]
    print(
        f"Decode blocks count the batch's KV blocks in all; {len(reachable)} of "
        f"{len(shapes.decode)} decode buckets are reachable (blocks <= batch x {per_seq}, "
        "a full-length sequence per row) and warmed",
        file=sys.stderr,
    )
    return 0


def build_config(args: argparse.Namespace) -> ShapeBucketConfig:
    """The config file's section with the flags laid over it, validated once."""
    data = dict(load_section(args.config)) if args.config else {}
    top = {
        "strategy": args.strategy,
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "file": args.file,
        **{dest: getattr(args, dest) for dest in _ENGINE_FLAGS},
    }
    data.update({k: v for k, v in top.items() if v is not None})
    for dest, (flag, phase, dim) in _RANGE_FLAGS.items():
        values = getattr(args, dest)
        if values is not None:
            section = data.get(phase) or {}
            if not isinstance(section, dict):
                raise ValueError(f"shape_buckets.{phase} must be a mapping")
            data[phase] = {**section, dim: BucketRange.parse(values, flag)}
    return ShapeBucketConfig.from_dict(data)


def load_section(path: Path) -> dict[str, Any]:
    """The `shape_buckets` mapping of a service YAML (also under `buckets:`), or the whole file."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"config {path} must be a mapping")
    if "buckets" not in data:
        return data.get("shape_buckets", data)
    # a service YAML: its shape keys, with the model's length and the pool's block size
    section = data["buckets"] or {}
    if "shape_buckets" in section:
        return section["shape_buckets"]
    shapes = {k: section[k] for k in ("strategy", "file", "prompt", "decode") if k in section}
    kv_cache = data.get("kv_cache") or {}
    block_size = kv_cache.get("block_size")
    max_model_len = (data.get("model") or {}).get("max_model_len")
    if block_size is not None:
        shapes["block_size"] = block_size
    if max_model_len is not None:
        shapes["max_model_len"] = max_model_len
    # the unified buckets' points: the decode engine's step limits and its pool
    engine = ((data.get("controller") or {}).get("decode")) or {}
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        shapes[key] = engine.get(key, SchedulerConfig.model_fields[key].default)
    if kv_cache.get("num_blocks") is not None:
        shapes["num_blocks"] = kv_cache["num_blocks"]
    return shapes
