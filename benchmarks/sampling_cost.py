"""The sampling features' cost on the engine's hot path, as paired A/B rounds in one process.

On a machine shared with other jobs, separate runs minutes apart mostly measure the
neighbours; here one loaded `LLM` runs every variant once per round, in a rotated order,
and each variant's throughput is divided by the `off` run of the same round, so slow drift
cancels. Variants: `off` (greedy, no logprobs), `lp5` (top 5 logprobs per token), `n4`
(n = 4 samples of each prompt, sharing its KV blocks) and `x4` (each prompt sent 4 times,
n = 1); the report gives the median per-round ratio and the spread.

    flock /tmp/bench.lock python -m benchmarks.sampling_cost --num-prompts 16 \\
        --max-new-tokens 32 --rounds 5 --out benchmarks/results/sampling_cost_ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

VARIANTS = ("off", "lp5", "n4", "x4")


def run_variant(llm: Any, prompts: list[list[int]], name: str, max_tokens: int) -> dict:
    from bucketserve.runtime.core.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        ignore_eos=True,
        logprobs=5 if name == "lp5" else None,
        n=4 if name == "n4" else 1,
    )
    batch = [p for p in prompts for _ in range(4)] if name == "x4" else prompts
    bm = llm.engine.block_manager
    peak = [0]
    execute = llm.engine.executor.execute

    def watched(seqs, counts):
        peak[0] = max(peak[0], bm.num_total_blocks - bm.num_free_blocks)
        return execute(seqs, counts)

    llm.engine.executor.execute = watched
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.engine.executor.execute = execute
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "peak_kv_blocks": peak[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--out", default="benchmarks/results/sampling_cost_ab.json")
    args = parser.parse_args()

    from benchmarks.workload import chat_prompts, encode_chats
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.engine.llm import LLM

    llm = LLM(args.model, dtype="float32", device="cpu", max_num_seqs=64)
    prompts = encode_chats(llm.tokenizer, chat_prompts(args.num_prompts))
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    rounds = []
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        result = {name: run_variant(llm, prompts, name, args.max_new_tokens) for name in order}
        rounds.append(result)
        print(f"round {r + 1}: " + ", ".join(f"{n} {result[n]['tok_s']:.1f} tok/s"
                                            for n in VARIANTS), flush=True)
    summary = {}
    for name in VARIANTS:
        ratios = [rd[name]["tok_s"] / rd["off"]["tok_s"] for rd in rounds]
        summary[name] = {
            "tok_s_median": statistics.median(rd[name]["tok_s"] for rd in rounds),
            "vs_off_median": statistics.median(ratios),
            "vs_off_min": min(ratios),
            "vs_off_max": max(ratios),
            "peak_kv_blocks": rounds[-1][name]["peak_kv_blocks"],
            "tokens": rounds[-1][name]["tokens"],
        }
    x4 = [rd["n4"]["tok_s"] / rd["x4"]["tok_s"] for rd in rounds]
    summary["n4"]["vs_x4_median"] = statistics.median(x4)
    print(f"\n{args.num_prompts} prompts, {args.max_new_tokens} new tokens, greedy, "
          f"{args.rounds} rounds (median of per-round ratios to `off`, [min, max])")
    for name, s in summary.items():
        print(f"{name:<4} {s['tok_s_median']:>8.1f} tok/s  x{s['vs_off_median']:.3f} "
              f"[{s['vs_off_min']:.3f}, {s['vs_off_max']:.3f}]  {s['tokens']} tokens, "
              f"peak {s['peak_kv_blocks']} KV blocks")
    print(f"n4 vs x4 (sharing vs separate requests): x{summary['n4']['vs_x4_median']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "rounds": rounds},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
