"""Plain-text tables of bench and comparison results."""

from __future__ import annotations

from typing import Any

TARGETS = (
    ("rate_at_target", ""),
    ("rate_at_target_uniform", ", every request judged by the base targets"),
)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.0f}"


def bench_table(result: dict[str, Any]) -> str:
    head = (f"{'rate':>6} {'sent':>5} {'ok':>5} {'req/s':>6} {'tok/s':>7} {'SLO%':>5} "
            f"{'good/s':>6} {'TTFT p50/p90/p99 ms':>20} {'TPOT p50/p90/p99 ms':>20} "
            f"{'e2e p50/p99 s':>13}")
    lines = [head]
    for run in result["runs"]:
        s = run["summary"]
        rate = f"{run['rate']:g}" if run["rate"] is not None else f"c{run['concurrency']}"
        ttft = "/".join(_ms(s["ttft"][k]) for k in ("p50", "p90", "p99"))
        tpot = "/".join(_ms(s["tpot"][k]) for k in ("p50", "p90", "p99"))
        e2e = "/".join("-" if s["e2e"][k] is None else f"{s['e2e'][k]:.1f}" for k in ("p50", "p99"))
        lines.append(
            f"{rate:>6} {s['sent']:>5} {s['completed']:>5} {s['request_throughput']:>6.2f} "
            f"{s['output_throughput']:>7.1f} {100 * s['slo_attainment']:>5.1f} "
            f"{s['goodput']:>6.2f} {ttft:>20} {tpot:>20} {e2e:>13}"
        )
        kinds = [f"{k} {100 * v['slo_attainment']:.1f}% of {v['count']}"
                 for k, v in s.get("per_kind", {}).items()]
        if s.get("uniform_slo_attainment") is not None:
            kinds.append(f"all by the base targets {100 * s['uniform_slo_attainment']:.1f}%")
        if len(kinds) > 1:
            lines.append(f"{'':>6} SLO: {', '.join(kinds)}")
        if s.get("refused"):
            lines.append(f"{'':>6} refused at once: {s['refused']}; SLO of the admitted "
                         f"{100 * s['admitted_slo_attainment']:.1f}%")
        if run.get("server"):
            server = ", ".join(f"{k}={v:g}" for k, v in sorted(run["server"].items()))
            lines.append(f"{'':>6} server: {server}")
    return "\n".join(lines)


def compare_table(result: dict[str, Any]) -> str:
    parts = []
    for name, res in result["systems"].items():
        parts += [f"== {name}", bench_table(res)]
    for key, judged in TARGETS:
        if key not in result:
            continue
        target = result[key]
        parts.append(f"rate at {100 * target['target']:.0f}% SLO attainment{judged}:")
        for name, found in target["systems"].items():
            rate = "-" if found["rate"] is None else f"{found['rate']:.3f} req/s"
            parts.append(f"  {name:<12} {rate} ({found['how']})")
        for pair, ratio in target["ratios"].items():
            parts.append(f"  {pair}: {'-' if ratio is None else f'{ratio:.2f}x'}")
    return "\n".join(parts)


def aggregate_table(results: list[dict[str, Any]]) -> str:
    """Median over repeated comparisons (e.g. seeds) of each system's rate at the target
    attainment and of the ratios; the runs' own values beside it."""
    import statistics

    def med(values: list[float | None]) -> str:
        known = [v for v in values if v is not None]
        return "-" if not known else f"{statistics.median(known):.3f}"

    lines = []
    for key, judged in TARGETS:
        if not all(key in r for r in results):
            continue
        first = results[0][key]
        lines.append(f"{len(results)} runs, rate at {100 * first['target']:.0f}% SLO attainment"
                     f"{judged} (req/s):")
        for name in first["systems"]:
            values = [r[key]["systems"][name]["rate"] for r in results]
            hows = [r[key]["systems"][name]["how"] for r in results]
            runs = ", ".join("-" if v is None else f"{v:.3f}" for v in values)
            lines.append(f"  {name:<12} median {med(values)}  runs [{runs}]  {sorted(set(hows))}")
        for pair in first["ratios"]:
            values = [r[key]["ratios"][pair] for r in results]
            runs = ", ".join("-" if v is None else f"{v:.2f}" for v in values)
            lines.append(f"  {pair:<24} median {med(values)}x  runs [{runs}]")
    lines.append(f"{len(results)} runs, medians per system and rate: SLO attainment (of the "
                 "admitted where some were refused), goodput (req/s), TTFT p90 (ms):")
    for name in results[0]["systems"]:
        per_rate: dict[float, list[dict[str, Any]]] = {}
        for result in results:
            for run in result["systems"][name]["runs"]:
                per_rate.setdefault(run["rate"], []).append(run["summary"])
        for rate, summaries in per_rate.items():
            admitted = [s.get("admitted_slo_attainment") for s in summaries]
            cells = [f"SLO {med([s['slo_attainment'] for s in summaries])}"]
            if any(a is not None for a in admitted):
                cells.append(f"admitted {med(admitted)}")
            cells += [f"goodput {med([s['goodput'] for s in summaries])}",
                      f"TTFT p90 {_ms(statistics.median(s['ttft']['p90'] for s in summaries))}"]
            lines.append(f"  {name:<12} {rate:>6g}  " + ", ".join(cells))
    return "\n".join(lines)
