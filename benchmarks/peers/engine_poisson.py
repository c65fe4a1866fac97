"""The in-process engine (`LLMEngine`, no server, no Ray) under the served sweep's Poisson
load, beside `vllm serve`'s figures from the served sweep's JSON.

    python -m benchmarks.peers.engine_poisson --rates 1,2,3 --num-prompts 100 --input-len 420

Same workload as `benchmarks.peers.served`, drawn as `vllm bench serve`'s random dataset
draws it: prompts of input_len ± range_ratio random tokens, output_len ± range_ratio tokens
out with EOS ignored, greedy, Poisson arrivals from `--seed` (the served prompts also carry
the chat template's ~36 tokens; `--input-len 420` matches them). Each request is added to
the engine at its arrival time while the engine steps; TTFT is first token minus arrival,
TPOT the mean gap after the first token, as `vllm bench serve` counts them. Shows what the
engine alone sustains, so the served path's own cost is the rest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers.harness import RESULTS_DIR, hardware_line, write_json
from bucketserve.bench.arrivals import PoissonArrivals


def lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), int(mean * (1 + ratio))
    return [int(x) for x in rng.integers(low, high + 1, n)]


def prompts(
    vocab: int, n: int, input_len: int, output_len: int, ratio: float, seed: int
) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per request."""
    rng = np.random.default_rng(seed)
    ins, outs = lengths(rng, n, input_len, ratio), lengths(rng, n, output_len, ratio)
    return [(rng.integers(0, vocab, i).tolist(), o) for i, o in zip(ins, outs, strict=True)]


def run(
    engine,
    work: list[tuple[list[int], int]],
    arrivals: list[float],
    slo: tuple[float, float] | None = None,
) -> list[dict]:
    """Feed `work` at `arrivals` (seconds from start) while stepping; per-request timings.
    `slo` (TTFT s, TPOT s): each request carries them as a colocated worker's engine gets
    them from the controller (a TTFT deadline from its arrival, a TPOT target)."""
    from bucketserve.runtime.core.sampling_params import SamplingParams

    records: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    next_i = 0
    while next_i < len(work) or engine.has_unfinished():
        now = time.perf_counter() - start
        while next_i < len(work) and arrivals[next_i] <= now:
            prompt, max_tokens = work[next_i]
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            targets = {}
            if slo is not None:
                late = now - arrivals[next_i]
                targets = {"ttft_deadline": time.monotonic() + slo[0] - late, "tpot_target": slo[1]}
            rid = engine.add_request(prompt, params, f"r{next_i}", **targets)
            records[rid] = {"arrival": arrivals[next_i], "times": []}
            next_i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[next_i] - now))
            continue
        outputs = engine.step()
        stamp = time.perf_counter() - start
        for out in outputs:
            records[out.request_id]["times"] += [stamp] * len(out.delta_token_ids)
    return list(records.values())


def summarize(records: list[dict], rate: float, slo_ttft: float, slo_tpot: float) -> dict:
    ttft = [r["times"][0] - r["arrival"] for r in records]
    tpot = [
        (r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1)
        for r in records if len(r["times"]) > 1
    ]
    tokens = sum(len(r["times"]) for r in records)
    span = max(r["times"][-1] for r in records) - min(r["arrival"] for r in records)
    ok = sum(a <= slo_ttft and b <= slo_tpot for a, b in zip(ttft, tpot, strict=True))
    return {
        "rate": rate,
        "completed": len(records),
        "output_tok_s": tokens / span,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "tpot_p50_ms": 1000 * float(np.percentile(tpot, 50)),
        "tpot_p90_ms": 1000 * float(np.percentile(tpot, 90)),
        "slo_attainment": ok / len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1,2")
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--input-len", type=int, default=384)
    parser.add_argument("--range-ratio", type=float, default=0.9)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=4.0)
    parser.add_argument("--slo-tpot", type=float, default=0.25)
    parser.add_argument("--slo-targets", action="store_true",
                        help="requests carry the SLO as the served colocated worker's do "
                        "(TTFT deadline, TPOT target), scheduled by priority as it does")
    parser.add_argument("--served", type=Path, default=RESULTS_DIR / "peers_served" / "served.json",
                        help="the served sweep's JSON whose vllm rows are shown beside")
    parser.add_argument("--out", default="peers_engine_poisson.json",
                        help="results file (a name under benchmarks/results, or a path)")
    args = parser.parse_args()

    from bucketserve.runtime.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(
        dtype="float32", device="cpu", max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048,
        scheduling_policy="priority" if args.slo_targets else "fcfs",
    )
    slo = (args.slo_ttft, args.slo_tpot) if args.slo_targets else None
    vocab = engine.runner.model_config.vocab_size
    work = prompts(
        vocab, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed
    )
    run(engine, [(p[:32], 4) for p, _ in work[:4]], [0.0] * 4)  # warm-up
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        arrivals = PoissonArrivals(args.seed).times(rate, len(work))
        records = run(engine, work, arrivals, slo)
        rows.append(summarize(records, rate, args.slo_ttft, args.slo_tpot))
    served = json.loads(args.served.read_text()) if args.served.is_file() else {}
    vllm = {r["rate"]: r for r in served.get("runs", {}).get("vllm", [])}
    print(f"{'system':<26} {'R':>3} {'tok/s':>7}  {'TTFT p50/p90 s':>15}  "
          f"{'TPOT p50/p90 ms':>16}  SLO")
    for row in rows:
        for name, r in (("bucketserve engine", row), ("vllm serve (sweep)", vllm.get(row["rate"]))):
            if r is None:
                continue
            print(f"{name:<26} {r['rate']:>3g} {r['output_tok_s']:>7.1f}  "
                  f"{r['ttft_p50_s']:>6.2f}/{r['ttft_p90_s']:<8.2f}  "
                  f"{r['tpot_p50_ms']:>7.0f}/{r['tpot_p90_ms']:<8.0f}  "
                  f"{r['slo_attainment']:.0%}")
    out = {"hardware": hardware_line(), "args": {k: str(v) for k, v in vars(args).items()},
           "engine": rows, "vllm_serve": [vllm[r["rate"]] for r in rows if r["rate"] in vllm],
           "vllm_served_prompts": served.get("workload", {}).get("num_prompts")}
    print(f"wrote {write_json(out, args.out)}")


if __name__ == "__main__":
    main()
