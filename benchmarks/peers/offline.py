"""Offline peer comparison: bucketserve's in-process engine vs vLLM's `LLM.generate`.

`--systems vllm,bucketserve,bucketserve-1p1d` adds the service's disaggregated topology: the
Controller with 1 prefill + 1 decode Ray actor, KV through Ray's object store (every
other setting the service's default), measured in the same invocation.

Same machine, same weights (bucketserve's safetensors copy of the embedded
SmolLM2), same prompt token ids, greedy, one invocation. Each system is loaded
once in its own process; repeats interleave the two (alternating which goes
first) and the ratio is the median of per-repeat ratios. vLLM runs with
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`. Both systems keep their default automatic prefix
caching (`--no-prefix-caching` turns it off in both, the setting of the earlier
comparisons), and every timed run starts from an empty cache, so a repeat reuses only what
its own prompts share.

Workloads:
- `chat`: the offline benchmark's 64 chat prompts (half short questions,
  half long answers), max_tokens 128 — output tok/s;
- `prefill`: 48 random-token prompts of 38-730 tokens, max_tokens 1 —
  prompt tok/s. Beside it, the machine's ceiling for that workload: its
  FLOPs (every GEMM, the LM head once per prompt, causal attention) at the
  float32 GEMM rate measured here before the workers start (a 2048^2 GEMM,
  the better of torch.matmul and the runtime's linear), and each system's
  share of it;
- `prefix`: the prefill benchmark over prompts that share long prefixes (system
  prompts, documents): `--num-prefixes` random prefixes of `--prefix-len` tokens,
  `--prefix-prompts` prompts in all, each one of them and its own random
  `--suffix-len` tokens, shuffled, max_tokens 1 — prompt tok/s over every prompt
  token, the cached ones included (as a user sees it). No FLOP ceiling: what is
  computed depends on the cache.

Each system's resident memory once loaded and warmed up (PSS of its process tree, both
with a 1 GiB KV pool) is in the table and the JSON.

    python -m benchmarks.peers.offline [--dtype float32] [--repeats 3] [--systems ...]
    python -m benchmarks.peers.offline --workloads prefix
    python -m benchmarks.peers.offline --model <a .gguf or HF dir> --workloads chat,prefill
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.peers.harness import (
    ISA_ENV,
    PEERS_DIR,
    Worker,
    hardware_line,
    hold_to_isa,
    identical,
    median,
    paired_ratio,
    peer_python,
    write_json,
)
from bucketserve.runtime.io.model_config import ModelConfig
from bucketserve.runtime.models import load_model_config

SCRIPTS = {
    "vllm": "vllm_offline.py",
    "bucketserve": "bucketserve_offline.py",
    "bucketserve-1p1d": "bucketserve_disagg.py",
}
BASELINE = "vllm"


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: int
    metric: str  # "output" or "prompt" tokens per second
    ceiling: bool = False  # report the machine's FLOP ceiling for it (every token computed)

    def tokens(self, token_ids: list[list[int]]) -> int:
        if self.metric == "prompt":
            return sum(len(p) for p in self.prompts)
        return sum(len(t) for t in token_ids)


def chat_workload(tokenizer, num_prompts: int, max_tokens: int) -> Workload:
    from benchmarks.workload import chat_prompts, encode_chats

    prompts = encode_chats(tokenizer, chat_prompts(num_prompts))
    return Workload("chat", prompts, max_tokens, "output")


def prefill_workload(vocab_size: int, num_prompts: int, seed: int = 0) -> Workload:
    """Random token ids (below the special tokens' range end) in prompts of 38-730 tokens."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(38, 731, size=num_prompts)
    prompts = [rng.integers(256, vocab_size, size=int(n)).tolist() for n in lengths]
    return Workload("prefill", prompts, 1, "prompt", ceiling=True)


def prefix_workload(
    vocab_size: int, num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int,
    seed: int = 0,
) -> Workload:
    """`num_prompts` prompts, each one of `num_prefixes` random prefixes (round robin) and
    its own random suffix, in a seeded random order."""
    if num_prompts < num_prefixes or min(num_prefixes, prefix_len, suffix_len) < 1:
        raise ValueError(f"{num_prompts} prompts over {num_prefixes} prefixes of "
                         f"{prefix_len} + {suffix_len} tokens")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(256, vocab_size, size=prefix_len).tolist()
                for _ in range(num_prefixes)]
    prompts = [prefixes[i % num_prefixes] + rng.integers(256, vocab_size, size=suffix_len).tolist()
               for i in range(num_prompts)]
    order = rng.permutation(num_prompts)
    return Workload("prefix", [prompts[i] for i in order], 1, "prompt")


def prefill_flops(config: ModelConfig, prompts: list[list[int]]) -> float:
    """FLOPs of prefilling `prompts` and sampling one token each: every layer's GEMMs over
    every token, the LM head over each prompt's last token, causal attention."""
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    total = 0.0
    for prompt in prompts:
        n = len(prompt)
        attention = 4 * q * n * (n + 1) / 2  # QK^T and PV over the causal triangle
        total += config.num_hidden_layers * (2 * n * layer + attention) + 2 * h * config.vocab_size
    return total


def ceiling(flops: float, tokens: int, gemm_rate: float, tok_s: dict[str, float]) -> dict:
    seconds = flops / gemm_rate
    return {
        "workload_gflop": flops / 1e9,
        "gemm_gflops": gemm_rate / 1e9,
        "tok_s": tokens / seconds,
        "share": {system: rate * seconds / tokens for system, rate in tok_s.items()},
    }


def start_workers(args: argparse.Namespace, model: str, warmup: list[list[int]]) -> dict:
    spec = {
        "model": model,
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "warmup_prompts": warmup,
        "execution": args.execution,
        "enable_prefix_caching": not args.no_prefix_caching,
    }
    workers = {}
    try:
        for name in args.systems:
            python = peer_python() if name == BASELINE else sys.executable
            workers[name] = Worker(name, python, PEERS_DIR / SCRIPTS[name], spec)
    except BaseException:
        for worker in workers.values():
            worker.close()
        raise
    return workers


def measure(workers: dict[str, Worker], workloads: list[Workload], repeats: int) -> dict:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        w.name: {s: [] for s in workers} for w in workloads
    }
    for i in range(repeats):
        order = list(workers) if i % 2 == 0 else list(reversed(workers))
        for w in workloads:
            for name in order:
                print(f"[repeat {i + 1}/{repeats}] {w.name}: {name} ...", flush=True)
                out = workers[name].run({"prompts": w.prompts, "max_tokens": w.max_tokens})
                out["tok_s"] = w.tokens(out["token_ids"]) / out["wall_s"]
                runs[w.name][name].append(out)
    return runs


def summarize(
    workloads: list[Workload], runs: dict, workers: dict[str, Worker], config: ModelConfig,
    gemm_rate: float,
) -> dict:
    """Per workload: each system's median tok/s, and each bucketserve system's paired ratio
    to vLLM and its fewest sequences token-identical to vLLM's in a repeat."""
    table = {}
    for w in workloads:
        theirs = runs[w.name][BASELINE]
        ours = {s: runs[w.name][s] for s in workers if s != BASELINE}
        table[w.name] = {
            "metric": f"{w.metric} tok/s",
            "num_prompts": len(w.prompts),
            "prompt_tokens": sum(len(p) for p in w.prompts),
            "max_tokens": w.max_tokens,
            "tok_s": {s: median([r["tok_s"] for r in runs[w.name][s]]) for s in workers},
            "ratio": {
                s: paired_ratio([r["tok_s"] for r in rs], [r["tok_s"] for r in theirs])
                for s, rs in ours.items()
            },
            "identical": {
                s: min(identical(a["token_ids"], b["token_ids"]) for a, b in zip(rs, theirs,
                                                                                 strict=True))
                for s, rs in ours.items()
            },
            "runs": {s: [{k: v for k, v in r.items() if k != "token_ids"}
                         for r in runs[w.name][s]] for s in workers},
        }
        if w.ceiling:
            row = table[w.name]
            row["ceiling"] = ceiling(prefill_flops(config, w.prompts), row["prompt_tokens"],
                                     gemm_rate, row["tok_s"])
    return table


def print_table(out: dict) -> None:
    print(f"\n{out['hardware']}; {out['args']['dtype']}, medians of {out['args']['repeats']}")
    for name, info in out["systems"].items():
        print(f"  {name}: {info['version']}, loaded in {info['load_s']:.1f} s, "
              f"resident {info['pss_mib']:.0f} MiB")
    header = (f"{'workload':<9} {'metric':<15} {'system':<17} {'tok/s':>8} {'vs vLLM':>8} "
              f"{'identical':>10}")
    print(header + "\n" + "-" * len(header))
    for name, row in out["workloads"].items():
        for system, tok_s in row["tok_s"].items():
            ratio, same = row["ratio"].get(system), row["identical"].get(system)
            print(f"{name:<9} {row['metric']:<15} {system:<17} {tok_s:>8.1f} "
                  + (f"{ratio:>7.2f}x {same:>4}/{row['num_prompts']:<5}" if ratio else ""))
        if "ceiling" in row:
            top = row["ceiling"]
            shares = ", ".join(f"{s} {v:.0%}" for s, v in top["share"].items())
            print(f"{'':<9} ceiling: {top['workload_gflop']:.0f} GFLOP at {top['gemm_gflops']:.0f}"
                  f" GFLOP/s (a 2048^2 GEMM) = {top['tok_s']:.0f} tok/s; shares: {shares}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a .gguf or HF model dir (default: the embedded SmolLM2); both "
                             "systems load bucketserve's safetensors conversion of it")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default="chat,prefill,prefix")
    parser.add_argument("--num-prompts", type=int, default=64, help="chat workload")
    parser.add_argument("--max-tokens", type=int, default=128, help="chat workload")
    parser.add_argument("--prefill-prompts", type=int, default=48)
    parser.add_argument("--prefix-prompts", type=int, default=48, help="prefix workload")
    parser.add_argument("--num-prefixes", type=int, default=4, help="prefix workload")
    parser.add_argument("--prefix-len", type=int, default=768, help="prefix workload")
    parser.add_argument("--suffix-len", type=int, default=48, help="prefix workload")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="both systems without automatic prefix caching")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--execution", default="eager", choices=["eager", "graphs"],
                        help="bucketserve's execution mode (graphs: compiled per shape)")
    parser.add_argument("--systems", default="vllm,bucketserve",
                        help=f"comma-separated, vllm first: {', '.join(SCRIPTS)}")
    parser.add_argument("--isa", default=None, choices=sorted(ISA_ENV),
                        help="hold both systems to this ISA on a CPU that has more")
    parser.add_argument("--out", default=None, help="default: peers_offline_<dtype>.json")
    args = parser.parse_args()
    hold_to_isa(args.isa)
    args.systems = args.systems.split(",")
    unknown = sorted(set(args.systems) - set(SCRIPTS))
    if unknown or args.systems[0] != BASELINE or len(set(args.systems)) < 2:
        parser.error(f"--systems takes vllm, then one or more of {', '.join(list(SCRIPTS)[1:])}"
                     f" (no repeats); got {','.join(args.systems)}")

    import torch

    from benchmarks.roofline import gemm_rate
    from bucketserve.runtime.io.tokenizer import Tokenizer
    from bucketserve.runtime.loader.model_files import resolve_model

    model_dir = resolve_model(args.model)
    config = load_model_config(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    every = {
        "chat": lambda: chat_workload(tokenizer, args.num_prompts, args.max_tokens),
        "prefill": lambda: prefill_workload(
            config.vocab_size, args.prefill_prompts
        ),
        "prefix": lambda: prefix_workload(
            config.vocab_size, args.prefix_prompts, args.num_prefixes, args.prefix_len,
            args.suffix_len,
        ),
    }
    workloads = [every[name]() for name in args.workloads.split(",")]
    warmup = [p[:64] for w in workloads for p in w.prompts[:2]]
    # before the workers load: the machine to itself
    rate = gemm_rate(dtype=getattr(torch, args.dtype))["best"]
    workers = start_workers(args, str(model_dir), warmup)
    try:
        runs = measure(workers, workloads, args.repeats)
    finally:
        for worker in workers.values():
            worker.close()
    out = {
        "hardware": hardware_line(),
        "model": str(model_dir),
        "args": vars(args),
        "systems": {name: w.info for name, w in workers.items()},
        "workloads": summarize(workloads, runs, workers, config, rate),
    }
    print_table(out)
    print(f"wrote {write_json(out, args.out or f'peers_offline_{args.dtype}.json')}")


if __name__ == "__main__":
    main()
