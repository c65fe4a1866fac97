"""Tensor parallel 2 vs 1 on one CPU: prefill and decode tok/s through `runtime.LLM`.

SmolLM2-135M itself does not split over two ranks (9 attention heads, 3 KV heads), so
this runs a seeded random model of its shape with the heads re-cut to split: hidden 576,
30 layers, MLP 1536, vocab 49152, 12 heads of 48 and 4 KV heads (q, k, v and every other
GEMM the same size as SmolLM2's), float32, eager. Each configuration in its own
subprocess with the same intra-op thread budget: `tp1` one process with 2 threads, `tp2`
two ranks (this process and a spawned one, gloo) with 1 thread each. Prefill tok/s:
`--num-prompts` prompts of `--prompt-len` tokens computed, one output token each; decode
tok/s: the extra tokens of a second run to `--max-new-tokens`, over its extra time.

    flock /tmp/bench.lock python -m benchmarks.tensor_parallel \\
        --out benchmarks/results/tensor_parallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIGS = {"tp1": (1, 2), "tp2": (2, 1)}  # name: (ranks, intra-op threads per rank)
SHAPE = {"num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 48}


def make_model(out: Path) -> Path:
    """SmolLM2-135M's config and tokenizer (the embedded default), heads re-cut (`SHAPE`),
    random weights; written once."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bucketserve.runtime.loader.model_files import resolve_model

    if (out / "model.safetensors").is_file():
        return out
    smollm = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig.from_pretrained(smollm)
    for key, value in SHAPE.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for f in smollm.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def run_config(args: argparse.Namespace, name: str) -> dict[str, Any]:
    import torch

    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.engine.llm import LLM

    ranks, threads = CONFIGS[name]
    torch.set_num_threads(threads)
    llm = LLM(
        str(args.model),
        tensor_parallel_size=ranks,
        stage_torch_threads=threads,
        execution="eager",
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=args.num_prompts * args.prompt_len,
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 49152) for _ in range(args.prompt_len)]
        for _ in range(args.num_prompts)
    ]

    def timed(n: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

    timed(2)  # warm: first-touch of the pool, oneDNN primitives
    prefill_s, _ = timed(1)
    total_s, tokens = timed(args.max_new_tokens)
    llm.close()
    extra = args.num_prompts * (args.max_new_tokens - 1)
    return {
        "config": name,
        "ranks": ranks,
        "threads_per_rank": threads,
        "prefill_s": prefill_s,
        "prefill_tok_s": args.num_prompts * args.prompt_len / prefill_s,
        "decode_tok_s": extra / (total_s - prefill_s),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, default=Path("/tmp/bucketserve-tp-bench-model"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)  # a child run
    args = parser.parse_args()
    if args.config:
        print(json.dumps(run_config(args, args.config)))
        return
    make_model(args.model)
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    results = []
    for name in CONFIGS:
        cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--config", name,
               "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
               "--max-new-tokens", str(args.max_new_tokens),
               "--model", str(args.model)]  # fmt: skip
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    same = results[0]["tokens"] == results[1]["tokens"]
    for r in results:
        print(
            f"{r['config']}: {r['ranks']} rank(s) x {r['threads_per_rank']} thread(s): "
            f"prefill {r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s"
        )
    print(f"greedy tokens equal: {same}")
    report = {
        "machine": f"{os.cpu_count()} cores, shared with other work",
        "args": {k: str(v) for k, v in vars(args).items() if k != "config"},
        "same_tokens": same,
        "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results],
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
