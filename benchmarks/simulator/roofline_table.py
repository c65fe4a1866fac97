"""The cost model itself, for every stated model on every stated accelerator: what one
step costs by the roofline, how much K/V fits, and how long a prompt's K/V takes to move.

No simulation: these are the numbers every experiment's events are made of, so a reader
can check them against published measurements (e.g. vLLM's Llama-2-7B decode on A100).
"""

from __future__ import annotations

from benchmarks.simulator.cost_model import CostModel
from benchmarks.simulator.hardware import HARDWARE, LINKS
from benchmarks.simulator.model_spec import MODELS
from benchmarks.simulator.report import table

ACCELERATORS = {"a100-40gb": "nvlink3", "h100-sxm": "nvlink4", "gaudi2": "gaudi2-roce-3x100g"}
PAPER_MODELS = ("llama-2-7b", "llama-2-13b", "opt-13b")
PROMPT = 1024


def run_roofline_table(tp: int = 1) -> dict:
    rows = []
    for hardware, link in ACCELERATORS.items():
        for model in PAPER_MODELS:
            cost = CostModel(MODELS[model], HARDWARE[hardware], tp, LINKS[link])
            try:
                kv_tokens = cost.kv_capacity_tokens()
            except ValueError:  # the weights alone fill the accelerator
                kv_tokens = 0
            rows.append(
                {
                    "hardware": hardware,
                    "model": model,
                    "weights_gb": MODELS[model].weight_bytes / 1e9,
                    "kv_tokens": kv_tokens,
                    "prefill_1x1024_ms": 1000 * cost.prefill_time([PROMPT]),
                    "prefill_8x1024_ms": 1000 * cost.prefill_time([PROMPT] * 8),
                    "decode_b1_ms": 1000 * cost.decode_time(1, PROMPT),
                    "decode_b64_ms": 1000 * cost.decode_time(64, 64 * PROMPT),
                    "b64_fits": kv_tokens >= 64 * (PROMPT + 1),
                    "kv_transfer_1024_ms": 1000 * cost.transfer_time(PROMPT, LINKS[link]),
                    "link": link,
                }
            )
    return {"tp": tp, "prompt": PROMPT, "rows": rows}


def roofline_table(result: dict) -> str:
    return table(
        f"Cost model (tp {result['tp']}): step times by the roofline, K/V of a "
        f"{result['prompt']}-token prompt over the link",
        (
            "hardware",
            "model",
            "weights GB",
            "KV tokens",
            "prefill 1x1024 ms",
            "prefill 8x1024 ms",
            "decode b1 ms",
            "decode b64 ms",
            "b64 fits",
            "KV move ms",
            "link",
        ),
        [
            (
                r["hardware"],
                r["model"],
                r["weights_gb"],
                r["kv_tokens"],
                r["prefill_1x1024_ms"],
                r["prefill_8x1024_ms"],
                r["decode_b1_ms"],
                r["decode_b64_ms"],
                "yes" if r["b64_fits"] else "no",
                r["kv_transfer_1024_ms"],
                r["link"],
            )
            for r in result["rows"]
        ],
    )
