"""Soak: minutes of Poisson load through HTTP and gRPC against the default deployment, with
requests cancelled at random points, a worker SIGKILLed and one SIGSTOPped (hung) every
fault period, and a burst of malformed requests; then a drain. Never part of `make test`.

    python -m benchmarks.soak --minutes 10        # starts `bucketserve serve` itself
    python -m benchmarks.soak --minutes 2 --url http://127.0.0.1:8000 --grpc 127.0.0.1:50051

It reports the requests sent, admitted, finished, cancelled (by the client or the server),
failed (with the reason each gave), rejected at admission (with their codes) and lost
(admitted, no final message); TTFT percentiles; how each malformed request was answered;
each fault and the seconds until a probe request completed again; the KV blocks still in
use after the drain (`bucketserve:kv_cache_blocks_used` on /metrics) and, for a service it
started, the processes left after Ctrl-C. A table on stdout, JSON under
benchmarks/results/soak/. The goal: 0 lost, 0 leaked, every failure with a reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve_process import ServeProcess, worker_processes
from benchmarks.soak_faults import FaultDrill
from benchmarks.soak_traffic import (
    CANCELLED,
    FAILED,
    FINISHED,
    LOST,
    REJECTED,
    Outcome,
    Plan,
    Traffic,
)

RESULTS = Path(__file__).resolve().parent / "results" / "soak"


@dataclass
class SoakConfig:
    minutes: float = 10.0
    rate: float = 0.5  # requests per second, Poisson
    cancel_fraction: float = 0.2
    max_tokens: int = 32
    fault_every_s: float = 60.0  # each period: a SIGKILL at 1/3, a SIGSTOP at 2/3, a burst at 5/6
    stop_s: float = 15.0  # a SIGSTOPped worker gets SIGCONT after this long (0: never)
    faults: bool = True
    seed: int = 0
    drain_s: float = 600.0
    stall_s: float = 600.0  # an admitted request with no final message this long is lost


@dataclass
class Soak:
    """One soak against one running service."""

    config: SoakConfig
    traffic: Traffic
    drill: FaultDrill | None
    http_url: str
    outcomes: list[Outcome] = field(default_factory=list)
    malformed: list[dict[str, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    async def run(self) -> dict[str, Any]:
        c = self.config
        start = time.monotonic()
        end = start + c.minutes * 60
        before = scrape(self.http_url)
        async with self.traffic:
            faults = asyncio.create_task(self._faults(start, end))
            running = await self._load(end)
            await faults
            if self.drill is not None:
                self.drill.resume()
            await asyncio.gather(*running, return_exceptions=True)  # each ends by stall_s
            drained = await self._drain()
        return self.report(time.monotonic() - start, before, drained)

    async def _load(self, end: float) -> set[asyncio.Task]:
        """Requests until `end`, Poisson arrivals; the ones still running."""
        rng = random.Random(self.config.seed)
        running: set[asyncio.Task] = set()
        index = 0
        while time.monotonic() < end:
            plan = Plan.draw(index, rng, self.config.max_tokens, self.config.cancel_fraction)
            task = asyncio.create_task(self.traffic.send(plan))
            task.add_done_callback(lambda t: self.outcomes.append(t.result()))
            running.add(task)
            task.add_done_callback(running.discard)
            index += 1
            gap = rng.expovariate(self.config.rate)
            await asyncio.sleep(min(gap, max(0.0, end - time.monotonic())))
        return running

    async def _faults(self, start: float, end: float) -> None:
        """Each period: a SIGKILL at 1/3, a SIGSTOP at 2/3, a malformed burst at 5/6; a fault
        waits for the previous one's recovery."""
        period = self.config.fault_every_s
        events = []
        for k in range(int((end - start) // period) + 1):
            base = start + k * period
            events += [(base + period / 3, "kill"), (base + 2 * period / 3, "stop"),
                       (base + 5 * period / 6, "malformed")]
        for at, kind in events:
            if at >= end:
                break
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if time.monotonic() >= end:
                break
            if kind == "malformed":
                self.malformed.append(await self.traffic.malformed_burst())
            elif self.drill is not None and self.config.faults:
                fault = await (self.drill.kill() if kind == "kill" else self.drill.stop())
                if fault is None:
                    self.notes.append(f"{kind} at {at - start:.0f}s skipped: no worker process")

    async def _drain(self) -> dict[str, Any]:
        """/metrics once nothing runs or waits and no KV block is in use (or `drain_s`
        passed): what it then says."""
        deadline = time.monotonic() + self.config.drain_s
        while True:
            families = await asyncio.to_thread(scrape, self.http_url)
            state = {
                "running": _value(families, "bucketserve:num_requests_running"),
                "waiting": _value(families, "bucketserve:num_requests_waiting"),
                "kv_blocks_used": _value(families, "bucketserve:kv_cache_blocks_used"),
                "kv_usage": _value(families, "bucketserve:kv_cache_usage_perc"),
            }
            idle = not state["running"] and not state["waiting"] and not state["kv_usage"]
            if idle or time.monotonic() > deadline:
                state["families"] = families
                state["drained_in_time"] = idle
                return state
            await asyncio.sleep(1.0)

    def report(self, duration_s: float, before: dict, drained: dict[str, Any]) -> dict[str, Any]:
        families = drained.pop("families")
        outcomes = sorted(self.outcomes, key=lambda o: o.plan.index)
        ttfts = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
        malformed: dict[str, int] = {}
        for burst in self.malformed:
            for answer, n in burst.items():
                malformed[answer] = malformed.get(answer, 0) + n
        faults = self.drill.faults if self.drill is not None else []
        return {
            "config": asdict(self.config),
            "duration_s": duration_s,
            "requests": _counts(outcomes),
            "by_protocol": {p: _counts([o for o in outcomes if o.plan.protocol == p])
                            for p in ("http", "grpc")},
            "ttft_s": {"p50": _percentile(ttfts, 50), "p99": _percentile(ttfts, 99),
                       "max": ttfts[-1] if ttfts else None},
            "malformed": {"sent": sum(malformed.values()), "answers": malformed},
            "faults": [f.as_dict() for f in faults],
            "after_drain": {**drained, "kv_blocks_leaked": drained["kv_blocks_used"]},
            "server": {
                "finished_by_reason": _delta(before, families, "bucketserve:request_success_total",
                                             "finished_reason"),
                "rejected_by_code": _delta(before, families, "bucketserve:request_rejected_total",
                                           "code"),
            },
            "lost": [o.as_dict() for o in outcomes if o.status == LOST],
            "untyped_failures": [o.as_dict() for o in outcomes
                                 if o.status in (FAILED, REJECTED) and not o.reason],
            "notes": self.notes,
        }


def _counts(outcomes: list[Outcome]) -> dict[str, Any]:
    def reasons(status: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for o in outcomes:
            if o.status == status:
                key = o.reason[:120] or "(no reason)"
                found[key] = found.get(key, 0) + 1
        return found

    cancelled = [o for o in outcomes if o.status == CANCELLED]
    return {
        "sent": len(outcomes),
        "admitted": sum(o.admitted for o in outcomes),
        "finished": sum(o.status == FINISHED for o in outcomes),
        "cancelled_by_client": sum(o.reason.startswith("by the client") for o in cancelled),
        "cancelled_by_server": sum(o.reason.startswith("by the server") for o in cancelled),
        "failed": reasons(FAILED),
        "rejected": reasons(REJECTED),
        "lost": sum(o.status == LOST for o in outcomes),
    }


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def scrape(http_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=60) as response:
        text = response.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def _value(families: dict[str, Any], name: str) -> float | None:
    """The sum of a family's samples (None: the server has no such metric)."""
    family = families.get(name)
    if family is None:
        return None
    return sum(s.value for s in family.samples if s.name == name)


def _delta(before: dict, after: dict, name: str, label: str) -> dict[str, float]:
    def by_label(families: dict) -> dict[str, float]:
        family = families.get(name.removesuffix("_total"))
        if family is None:
            return {}
        return {s.labels.get(label, ""): s.value for s in family.samples if s.name == name}

    old, new = by_label(before), by_label(after)
    return {k: v - old.get(k, 0.0) for k, v in new.items() if v - old.get(k, 0.0)}


def table(report: dict[str, Any]) -> str:
    c, r = report["config"], report["requests"]
    lines = [
        f"soak: {report['duration_s'] / 60:.1f} min, {c['rate']:g} req/s offered (Poisson), "
        f"HTTP + gRPC, {c['cancel_fraction']:.0%} cancelled at random points, faults every "
        f"{c['fault_every_s']:g} s" + ("" if c["faults"] else " (off)"),
        "",
        f"{'requests':<16}sent {r['sent']}  admitted {r['admitted']}  finished {r['finished']}"
        f"  cancelled {r['cancelled_by_client']} by the client, {r['cancelled_by_server']} "
        f"by the server  failed {sum(r['failed'].values())}  rejected "
        f"{sum(r['rejected'].values())}  lost {r['lost']}",
    ]
    for kind in ("failed", "rejected"):
        for reason, n in sorted(r[kind].items(), key=lambda kv: -kv[1]):
            lines.append(f"{'':<16}{kind}: {n} x {reason}")
    for protocol, p in report["by_protocol"].items():
        lines.append(
            f"{protocol:<16}sent {p['sent']}  finished {p['finished']}  cancelled "
            f"{p['cancelled_by_client'] + p['cancelled_by_server']}  failed "
            f"{sum(p['failed'].values())}  rejected {sum(p['rejected'].values())}  lost {p['lost']}"
        )
    t = report["ttft_s"]
    ttft = "-" if t["p50"] is None else (
        f"p50 {t['p50']:.2f} s  p99 {t['p99']:.2f} s  max {t['max']:.2f} s"
    )
    lines.append(f"{'TTFT':<16}{ttft}")
    m = report["malformed"]
    answers = ", ".join(f"{n} {a}" for a, n in sorted(m["answers"].items()))
    lines.append(f"{'malformed':<16}{m['sent']} sent: {answers or '-'}")
    lines.append(f"{'faults':<16}{'kind':<9}{'at':>7}  {'worker':<20}{'recovered':>10}")
    for f in report["faults"]:
        recovered = f"{f['recovered_s']:.1f} s" if f["recovered_s"] is not None else "NEVER"
        held = f" (stopped {f['held_s']:.0f} s)" if f["kind"] == "sigstop" else ""
        lines.append(f"{'':<16}{f['kind']:<9}{f['at_s']:>6.0f}s  {f['worker']:<20}"
                     f"{recovered:>10}{held}")
    d = report["after_drain"]
    blocks = "?" if d["kv_blocks_used"] is None else f"{d['kv_blocks_used']:g}"
    lines.append(
        f"{'after drain':<16}running {d['running']:g}  waiting {d['waiting']:g}  KV blocks in "
        f"use {blocks}" + ("" if d["drained_in_time"] else "  (not drained in time)")
    )
    if "leftover_processes" in report:
        left = report["leftover_processes"]
        lines.append(f"{'after Ctrl-C':<16}exit {report['exit_status']}, processes left: "
                     + (", ".join(left) if left else "none"))
    s = report["server"]
    lines.append(f"{'server counted':<16}finished {s['finished_by_reason']}  rejected "
                 f"{s['rejected_by_code']}")
    goal = (r["lost"] == 0 and not d["kv_blocks_used"] and not report["untyped_failures"]
            and all(f["recovered_s"] is not None for f in report["faults"]))
    lines.append(f"{'goal':<16}0 lost, 0 leaked, every failure typed, every fault recovered: "
                 + ("MET" if goal else "NOT MET"))
    for note in report["notes"]:
        lines.append(f"{'note':<16}{note}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    parser.add_argument("--minutes", type=float, default=d.minutes)
    parser.add_argument("--rate", type=float, default=d.rate, help="requests/s (Poisson)")
    parser.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction)
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--fault-every", type=float, default=d.fault_every_s, metavar="S")
    parser.add_argument("--stop-s", type=float, default=d.stop_s,
                        help="SIGCONT a stopped worker after this long (0: leave it stopped "
                        "for the service to detect)")
    parser.add_argument("--no-faults", action="store_true", help="no SIGKILL / SIGSTOP")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--url", help="HTTP base URL of a running service (default: start one)")
    parser.add_argument("--grpc", help="its gRPC target (with --url)")
    parser.add_argument("--api-key", help="a tenant's key, if the service has tenants")
    parser.add_argument("--config", type=Path, help="service YAML for the service it starts")
    parser.add_argument("--out", type=Path, help="JSON report path")
    args = parser.parse_args(argv)
    if args.url and not args.grpc:
        parser.error("--url needs --grpc (the gRPC target of the same service)")
    return args


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    config = SoakConfig(
        minutes=args.minutes, rate=args.rate, cancel_fraction=args.cancel_fraction,
        max_tokens=args.max_tokens, fault_every_s=args.fault_every, stop_s=args.stop_s,
        faults=not args.no_faults, seed=args.seed,
    )
    served = None
    if args.url:
        http_url, grpc_target = args.url.rstrip("/"), args.grpc
        model = json.loads(urllib.request.urlopen(f"{http_url}/v1/models", timeout=60).read())
        model_name, workers = model["data"][0]["id"], worker_processes
    else:
        import yaml

        service = yaml.safe_load(args.config.read_text()) if args.config else {}
        service.setdefault("gateway", {}).update(grpc_port=0, http_port=0)
        workdir = Path(tempfile.mkdtemp(prefix="bucketserve-soak-"))
        print(f"starting bucketserve serve (log: {workdir / 'serve.log'}) ...", flush=True)
        served = await asyncio.to_thread(ServeProcess.start, service, workdir)
        http_url, grpc_target, model_name = served.http_url, served.grpc_target, served.model_name
        workers = served.workers
    started = time.monotonic()
    traffic = Traffic(grpc_target, http_url, model_name, args.api_key, stall_s=600.0)
    drill = FaultDrill(grpc_target, workers, started, args.api_key, stop_s=config.stop_s)
    try:
        report = await Soak(config, traffic, drill, http_url).run()
        if served is not None:
            report["service_log"] = str(served.log)
            report["exit_status"] = await asyncio.to_thread(served.interrupt)
            report["leftover_processes"] = await asyncio.to_thread(served.leftovers)
    finally:
        drill.resume()
        if served is not None:
            served.close()
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(soak(args))
    out = args.out or RESULTS / f"soak_{args.minutes:g}min_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(table(report))
    print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
