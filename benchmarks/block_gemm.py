"""The GEMM over GGUF blocks at rising row counts, against the float32 GEMM of the same
weight: where `BlockGemm.PROMPT_ROWS` (integer kernel below, expansion + torch's GEMM from
there) comes from. Qwen2.5-0.5B's MLP shapes, seeded random weights quantized by `gguf`.

    python -m benchmarks.block_gemm --out benchmarks/results/gguf/block_gemm_zen3.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np
import torch

from benchmarks.decode_step import timed
from bucketserve.runtime.cpu.block_gemm import BlockGemm
from bucketserve.runtime.io.quantized import QuantizedTensor

SHAPES = ((4864, 896), (896, 4864))  # gate (or up), down
ROWS = (1, 16, 64, 128, 256, 512)


def median_ms(fn, repeats: int = 7) -> float:
    return timed(fn, repeats) * 1e3


def timings(weight: QuantizedTensor, dense: torch.Tensor, rows: int) -> dict[str, float]:
    """ms of the integer kernel, of expanding the weight + torch's GEMM, of the float32 GEMM."""
    gemm = BlockGemm(weight)
    x = torch.randn(rows, gemm.in_features)
    out = torch.empty(rows, gemm.out_features)
    ids = torch.arange(gemm.out_features)
    kernel = gemm._kernels
    return {
        "integer_ms": median_ms(
            lambda: kernel.block_gemm(x, weight.blocks, weight.block_type, out, False)),
        "expanded_ms": median_ms(lambda: x @ gemm.rows(ids).T),
        "float32_ms": median_ms(lambda: x @ dense.T),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qtype", nargs="+", default=["Q8_0", "Q4_0"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gguf/block_gemm.json"))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows_out = []
    print(f"{'type':5} {'weight':>10} {'rows':>5} {'integer':>9} {'expanded':>9} "
          f"{'float32':>9}  ms")
    for qtype in args.qtype:
        kind = gguf.GGMLQuantizationType[qtype]
        for n, k in SHAPES:
            w = rng.standard_normal((n, k), dtype=np.float32) * 0.02
            weight = QuantizedTensor(torch.from_numpy(gguf.quants.quantize(w, kind)), qtype)
            for m in ROWS:
                t = timings(weight, torch.from_numpy(w), m)
                rows_out.append({"qtype": qtype, "n": n, "k": k, "rows": m, **t})
                print(f"{qtype:5} {n:>5}x{k:<4} {m:5} {t['integer_ms']:9.2f} "
                      f"{t['expanded_ms']:9.2f} {t['float32_ms']:9.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "results": rows_out, "threads": torch.get_num_threads(),
        "command": "python -m benchmarks.block_gemm " + " ".join(sys.argv[1:]),
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
