"""Conditional disaggregation at paper scale: `controller.remote_prefill` auto against the
two fixed shapes (always: every prompt on the prefill worker; never: each decode worker
prefills its own), and the layer-wise K/V handoff against the whole one.

The cluster is one prefill and three decode workers, each one H100-SXM serving Llama-2-13B
(NVLink 4 between them); the workloads the online experiment's mixed one (70 % Alpaca-like
chat, 30 % LongBench-like documents) and a documents-only one, judged by the mixed
workload's SLO (TTFT <= 5 s, TPOT <= 0.15 s). Every system is the real BucketManager and
the service's own `PDScheduler.route`, priced from the cost model; a prefill worker takes
two batches at once, as the service's do.
"""

from __future__ import annotations

import dataclasses

from benchmarks.simulator.cluster_config import ClusterConfig
from benchmarks.simulator.metrics import SloConfig, percentiles
from benchmarks.simulator.report import rate_at, table
from benchmarks.simulator.systems import SystemConfig, simulate
from benchmarks.simulator.workload import WorkloadConfig, make_workload

CLUSTER = ClusterConfig(
    model="llama-2-13b", hardware="h100-sxm", link="nvlink4", num_prefill=1, num_decode=3
)
SLO = SloConfig(5.0, 0.15)
RATES = {
    "mixed": tuple(float(r) for r in range(4, 33, 2)),
    "long": tuple(float(r) for r in range(2, 13)),
}
MODES = ("auto", "always", "never")
HANDOFF_RATES = {"mixed": (4.0, 8.0), "long": (2.0, 4.0)}  # below saturation: TTFT p90


def system(mode: str, layerwise: bool = True) -> SystemConfig:
    return SystemConfig(
        remote_prefill=mode, layerwise=layerwise, max_batches_per_prefill=2,
    )  # fmt: skip


def run_conditional(
    cluster: ClusterConfig = CLUSTER, duration_s: float = 60.0, seed: int = 0
) -> dict:
    out = {"cluster": dataclasses.asdict(cluster), "slo": dataclasses.asdict(SLO)}
    workloads = {}
    for dist, rates in RATES.items():
        rows = []
        for rate in rates:
            requests = _requests(cluster, dist, rate, duration_s, seed)
            for mode in MODES:
                result = simulate("bucketserve", cluster, requests, system(mode))
                local = result.stats["local_prefills"]
                rows.append({"rate": rate, "mode": mode, **result.summary(SLO), "local": local})
        at_80 = {
            mode: rate_at(
                [r["rate"] for r in rows if r["mode"] == mode],
                [r["slo_attainment"] for r in rows if r["mode"] == mode],
            )
            for mode in MODES
        }
        best = max(at_80["always"], at_80["never"])
        handoff = []
        for rate in HANDOFF_RATES[dist]:
            requests = _requests(cluster, dist, rate, duration_s, seed)
            for layerwise in (True, False):
                run = simulate("bucketserve", cluster, requests, system("always", layerwise))
                landed = [r.decode_start - r.arrival for r in run.records if r.decode_start]
                handoff.append({
                    "rate": rate, "layerwise": layerwise,
                    "ttft_p90_s": run.summary(SLO)["ttft_s"]["p90"],
                    "kv_landed_p90_s": percentiles(landed)["p90"],
                })  # fmt: skip
        workloads[dist] = {
            "rows": rows,
            "rate_at_80pct_slo": at_80,
            "auto_over_best_fixed": at_80["auto"] / best if best else None,
            "handoff": handoff,
        }
    out["workloads"] = workloads
    mixed = workloads["mixed"]
    return {
        "rate_at_80pct_slo": mixed["rate_at_80pct_slo"],
        "auto_over_best_fixed": mixed["auto_over_best_fixed"],
        "workload": "mixed: 70 % Alpaca-like chat, 30 % LongBench-like documents, Poisson, "
        f"{duration_s:g} s of arrivals per rate; SLO TTFT <= {SLO.ttft_s} s, TPOT <= "
        f"{SLO.tpot_s} s (the `long` entry: documents only)",
        "command": f"python -m benchmarks.simulator conditional_disagg --duration {duration_s:g}",
        **out,
    }


def _requests(cluster: ClusterConfig, dist: str, rate: float, duration_s: float, seed: int):
    n = max(20, int(rate * duration_s))
    return make_workload(WorkloadConfig(dist, n, rate, cluster.model_spec.max_len, seed=seed))


def conditional_table(result: dict) -> str:
    parts = []
    for dist, data in result["workloads"].items():
        rows = [
            (r["rate"], r["mode"], r["slo_attainment"], r["ttft_s"]["p90"], r["tpot_s"]["p90"],
             r["local"])
            for r in data["rows"]
        ]  # fmt: skip
        parts.append(table(
            f"Conditional disaggregation, {dist} (1 prefill + 3 decode H100, Llama-2-13B)",
            ("rate", "remote_prefill", "SLO att", "TTFT p90", "TPOT p90", "local prefills"),
            rows,
        ))  # fmt: skip
        at = data["rate_at_80pct_slo"]
        parts.append(table(
            f"{dist}: rate at 80 % SLO attainment (req/s)",
            ("auto", "always", "never", "auto / better fixed"),
            [(at["auto"], at["always"], at["never"], data["auto_over_best_fixed"])],
        ))  # fmt: skip
        parts.append(table(
            f"{dist}: remote_prefill always, K/V layer by layer vs whole (s; the first token "
            "leaves the prefill worker either way, the second waits for the K/V)",
            ("rate", "layer-wise", "TTFT p90", "K/V landed p90"),
            [(h["rate"], h["layerwise"], h["ttft_p90_s"], h["kv_landed_p90_s"])
             for h in data["handoff"]],
        ))  # fmt: skip
    return "\n".join(parts)
