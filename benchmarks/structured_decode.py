"""Decode-step cost of a JSON-schema token mask, on vs off, at batch 1, 8 and 32 (SmolLM2).

One loaded ModelRunner steps three sets of B sequences over the same prompts, one step of
each set per round in a rotated order, so the neighbours' load and the growing context
land on all three alike: `off` (no constraint), `on` (the schema's mask, computed on the
mask thread while the forward runs) and `serial` (the same mask computed after the
forward, on the caller's thread). Each variant's step time is divided by `off`'s in the
same round; the report gives medians. `mask_ms` is the mask computation alone (the
matchers' batched fill plus unpacking), timed again after the step. Sequences run with
ignore_eos, so a finished grammar (EOS only) keeps being masked, as a real batch would.

    flock /tmp/bench.lock python -m benchmarks.structured_decode \\
        --out benchmarks/results/structured_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"enum": ["Paris", "London", "Rome", "Berlin", "Madrid"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "address", "tags", "active"],
    "additionalProperties": False,
}
VARIANTS = ("off", "on", "serial")


def prompts(tokenizer, n: int) -> list[list[int]]:
    chats = [
        [{"role": "user", "content": f"Invent person number {i}: reply with their profile as "
                                     "JSON (name, age, email, address, tags, active)."}]
        for i in range(n)
    ]
    return [
        tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False)
        for c in chats
    ]


def run_batch(runner, batch: int, steps: int, warmup: int) -> dict:
    from bucketserve.runtime.core.block_manager import BlockManager
    from bucketserve.runtime.core.sampling_params import SamplingParams
    from bucketserve.runtime.core.sequence import Sequence
    from bucketserve.runtime.core.structured_outputs import StructuredOutputsParams

    structured = StructuredOutputsParams(json=SCHEMA)
    bm = BlockManager(runner.num_kv_blocks, runner.block_size, enable_prefix_caching=False)
    ids = prompts(runner.tokenizer, batch)
    sets = {}
    for name in VARIANTS:
        params = SamplingParams(
            temperature=0, max_tokens=10_000, ignore_eos=True,
            structured_outputs=None if name == "off" else structured,
        )  # fmt: skip
        seqs = [Sequence(p, params, seq_id=f"{name}-{batch}-{i}") for i, p in enumerate(ids)]
        for seq in seqs:
            bm.allocate(seq)
        sets[name] = seqs
    manager = runner.structured

    def step(name: str, counts: list[int] | None = None) -> float:
        seqs = sets[name]
        counts = counts or [1] * len(seqs)
        manager.overlap = name != "serial"
        start = time.perf_counter()
        tokens = runner.execute(seqs, counts)
        elapsed = time.perf_counter() - start
        for seq, token, n in zip(seqs, tokens, counts, strict=True):
            seq.num_computed_tokens += n
            seq.append_token(int(token))
            bm.append_slot(seq)
        return elapsed

    for name in VARIANTS:  # the prompts, then the mask's first step
        step(name, [len(s) for s in sets[name]])
    times = {name: [] for name in VARIANTS}
    mask_ms = []
    for r in range(warmup + steps):
        order = VARIANTS[r % 3:] + VARIANTS[: r % 3]
        took = {name: step(name) for name in order}
        start = time.perf_counter()
        manager.mask(sets["on"])  # synced already: the mask computation alone
        mask = time.perf_counter() - start
        if r >= warmup:
            for name in VARIANTS:
                times[name].append(took[name])
            mask_ms.append(mask * 1e3)
    off = times["off"]
    text = runner.tokenizer.decode(sets["on"][0].output_token_ids)
    for seq in (s for seqs in sets.values() for s in seqs):
        bm.free(seq)
    return {
        "batch": batch,
        "steps": steps,
        "off_ms": statistics.median(off) * 1e3,
        "on_ms": statistics.median(times["on"]) * 1e3,
        "serial_ms": statistics.median(times["serial"]) * 1e3,
        "on_vs_off": statistics.median(a / b for a, b in zip(times["on"], off, strict=True)),
        "serial_vs_off": statistics.median(
            a / b for a, b in zip(times["serial"], off, strict=True)
        ),
        "mask_ms": statistics.median(mask_ms),
        "context_tokens_end": len(sets["on"][0]),
        "sample_output": text[:200],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=24, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="benchmarks/results/structured_decode.json")
    args = parser.parse_args()

    from bucketserve.runtime.worker.model_runner import ModelRunner
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    runner = ModelRunner(
        ModelRunnerConfig(model=args.model, dtype=args.dtype, device="cpu", num_kv_blocks=2048)
    )
    start = time.perf_counter()
    runner.structured.compiler.ll_tokenizer  # noqa: B018  (the token table, built once)
    table_s = time.perf_counter() - start
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        row = run_batch(runner, batch, args.steps, args.warmup)
        rows.append(row)
        print(
            f"batch {batch:>3}: off {row['off_ms']:7.2f} ms  on {row['on_ms']:7.2f} ms "
            f"(x{row['on_vs_off']:.3f})  serial {row['serial_ms']:7.2f} ms "
            f"(x{row['serial_vs_off']:.3f})  mask alone {row['mask_ms']:.3f} ms",
            flush=True,
        )
    print(f"\nJSON-schema mask, SmolLM2 {args.dtype} on CPU, median of {args.steps} decode steps"
          f" per variant (ratios: median of same-round ratios to off)")
    print(f"{'batch':>5} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'serial ms':>10} "
          f"{'serial/off':>10} {'mask ms':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['off_ms']:>8.2f} {r['on_ms']:>8.2f} {r['on_vs_off']:>7.3f} "
              f"{r['serial_ms']:>10.2f} {r['serial_vs_off']:>10.3f} {r['mask_ms']:>8.3f}")
    print(f"token table built in {table_s:.2f} s (once per worker)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = {"cpus": os.cpu_count(), "machine": platform.machine(),
               "load_avg_1m": os.getloadavg()[0]}
    out.write_text(json.dumps({"args": vars(args), "machine": machine,
                               "token_table_s": table_s, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
