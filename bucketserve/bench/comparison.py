"""The same workload against the service in several configurations, each started here:

- `bucketserve`: adaptive request buckets (Algorithm 1) + tenant policies (an online FCFS
  tenant for short requests ahead of an offline SJF tenant for long ones, whose requests
  go first once they waited the tenant's aging bound: `ServiceSpec.batch_max_wait_s`);
- `fcfs`: one request bucket that never splits (`max_buckets=1`), one FCFS tenant, batches
  sized by memory and the token budget alone (padded, a batch of 5 runs as 8 rows) — the
  DistServe-like disaggregated FCFS baseline. Its engines start prompts in plain queue
  order, as vLLM's scheduler does (`SchedulerConfig.slo_admission` off);
- `fcfs-slo`: as `fcfs`, with the engines' SLO-aware admission that bucketserve runs, to
  separate what the tenant policies buy from what the admission buys (it acts in the
  colocated topology, where the engine prefills; a disaggregated decode engine only takes
  prefilled requests);
- `fcfs-fit`: as `fcfs`, with bucketserve's batch sizing to the warmed batch sizes
  (`BatchingConfig.fit_batch_buckets`), to separate what that alone buys (padded runs only);
- `shape-only`: as `fcfs`, with every batch padded to the fixed shape buckets;
- `cache-shares` / `no-cache-shares`: a `chat` tenant and a `noisy` one (their requests the
  `prefix-flood` workload's chat and doc kinds), with and without `NOISY_CACHE_SHARE` of the
  evictable cached blocks for `noisy`: what the shares keep of chat's cached system prompt;
- `shed` / `queue`: one `chat` tenant with the bench's TTFT and TPOT targets, `shed:
  predicted` or `never`: what predicted shedding keeps of the admitted requests' SLO under
  overload.

`ServiceSpec.padded` pads every system's batches to the shape buckets, as HPU and CUDA graphs
do: it measures on the CPU the padding that request buckets save on that hardware (then
`shape-only` is `fcfs`, so it is refused). `ServiceSpec.execution="graphs"` runs every system
on compiled graphs, one per shape bucket, all compiled at warm-up: padding is then what the
graphs impose, not a setting, and `shape-only` is refused the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

from bucketserve.bench.bench import Bench
from bucketserve.bench.config import BenchConfig
from bucketserve.bench.metrics import rate_at_attainment
from bucketserve.bench.server_metrics import ServerMetrics
from bucketserve.bench.service_harness import ServiceHarness
from bucketserve.bench.tenant_mix import TenantShare

SYSTEMS = (
    "bucketserve", "fcfs", "fcfs-slo", "fcfs-fit", "shape-only", "cache-shares",
    "no-cache-shares", "shed", "queue",
)  # fmt: skip
NOISY_CACHE_SHARE = 0.25
TENANTS = [
    {"name": "chat", "api_keys": ["chat-key"]},
    {"name": "batch", "api_keys": ["batch-key"], "class": "offline", "policy": "sjf",
     "priority": 1},
]


@dataclass(frozen=True)
class ServiceSpec:
    """The controller the harness starts: the embedded model (or `model`) in local mode."""

    model: str | None = None
    max_model_len: int = 1024
    block_size: int = 16
    num_kv_blocks: int | None = None
    mode: str = "local"
    padded: bool = False
    execution: str = "auto"
    topology: str | None = None  # the controller's default unless set
    batch_max_wait_s: float | None = None  # the batch tenant's aging bound; None: the default
    # every system's controller.decode.pace, with every tenant's TPOT target set to
    # `tpot_slo_s` (the bench's), which the pacing keeps
    decode_pace: float | None = None
    tpot_slo_s: float | None = None
    ttft_slo_s: float | None = None  # the `shed` / `queue` tenant's targets: these two

    def __post_init__(self) -> None:
        if self.decode_pace is not None:
            from bucketserve.utils.checks import check_pace

            check_pace("--decode-pace", self.decode_pace)
            if self.topology != "disaggregated":
                raise ValueError("--decode-pace needs --topology disaggregated: it holds decode "
                                 "steps for prefill workers' batches")
            if self.tpot_slo_s is None:
                raise ValueError("ServiceSpec.decode_pace needs tpot_slo_s, the target it keeps")
        wait = self.batch_max_wait_s
        if wait is not None and not (isinstance(wait, (int, float)) and wait > 0):
            raise ValueError(
                f"--batch-max-wait must be a number of seconds > 0, got {wait!r}; leave it out "
                "for the tenant default (30 s)"
            )

    @property
    def start_timeout_s(self) -> float:
        """How long a system may take to come up: graphs compile every bucket first
        (about 5 minutes for max_model_len 512 on two cores)."""
        return 1800.0 if self.execution == "graphs" else 300.0

    @property
    def pads(self) -> bool:
        """Every system pads to the shape buckets: asked for, or graphs need it."""
        return self.padded or self.execution == "graphs"


def system_setup(name: str, spec: ServiceSpec) -> tuple[Any, list[dict] | None, list[TenantShare]]:
    """(controller config, server tenants, client tenant mix) of one system."""
    from bucketserve.bucket_manager.config import TenantConfig
    from bucketserve.controller.config import ControllerConfig, DecodeConfig
    from bucketserve.deploy.serve_config import with_tenants
    from bucketserve.gateway.tenant_registry import TenantRegistry
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    runner = ModelRunnerConfig(
        model=spec.model, block_size=spec.block_size, num_kv_blocks=spec.num_kv_blocks,
        max_model_len=spec.max_model_len, execution=spec.execution,
    )
    padding = True if spec.pads else "auto"
    # graphs: every bucket compiled before serving; eager: one shape is enough
    warmup = "all" if spec.execution == "graphs" else "smallest"
    topology = {} if spec.topology is None else {"topology": spec.topology}
    base = ControllerConfig(
        runner=runner, mode=spec.mode, warmup=warmup, pad_to_shape_buckets=padding,
        decode=DecodeConfig(pace=spec.decode_pace), **topology,
    )
    # pacing keeps each request's TPOT target: both systems get the bench's
    targets = {} if spec.decode_pace is None else {"tpot_slo_s": spec.tpot_slo_s}
    if name == "bucketserve":
        tenants = [t | targets for t in TENANTS]
        if spec.batch_max_wait_s is not None:
            wait = {"max_wait_s": spec.batch_max_wait_s}
            tenants = [t | wait if t["name"] == "batch" else t for t in tenants]
        config = with_tenants(base, TenantRegistry.from_dict(tenants).bucket_configs())
        mix = [TenantShare("chat", 1.0, "chat-key"), TenantShare("batch", 1.0, "batch-key", "long")]
        return config, tenants, mix
    if name not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {name!r}")
    if name in ("cache-shares", "no-cache-shares"):
        share = {"cache_share": NOISY_CACHE_SHARE} if name == "cache-shares" else {}
        tenants = [
            {"name": "chat", "api_keys": ["chat-key"]},
            {"name": "noisy", "api_keys": ["noisy-key"], **share},
        ]
        mix = [TenantShare("chat", 1.0, "chat-key", "chat"),
               TenantShare("noisy", 1.0, "noisy-key", "doc")]  # fmt: skip
        return with_tenants(base, TenantRegistry.from_dict(tenants).bucket_configs()), tenants, mix
    if name in ("shed", "queue"):
        shed = "predicted" if name == "shed" else "never"
        tenants = [{"name": "chat", "api_keys": ["chat-key"], "ttft_slo_s": spec.ttft_slo_s,
                    "tpot_slo_s": spec.tpot_slo_s, "shed": shed}]  # fmt: skip
        config = with_tenants(base, TenantRegistry.from_dict(tenants).bucket_configs())
        return config, tenants, [TenantShare("chat", 1.0, "chat-key")]
    config = with_tenants(base, [TenantConfig(name="default", **targets)])
    one_bucket = config.buckets.request_buckets.model_copy(update={"max_buckets": 1})
    batching = config.buckets.batching.model_copy(update={"fit_batch_buckets": name == "fcfs-fit"})
    fcfs = {"scheduling_policy": "fcfs", "slo_admission": name == "fcfs-slo"}
    config = config.model_copy(
        update={
            "buckets": dataclasses.replace(
                config.buckets, request_buckets=one_bucket, batching=batching
            ),
            "pad_to_shape_buckets": spec.pads or name == "shape-only",
            "decode": config.decode.model_copy(update=fcfs),
        }
    )
    return config, None, [TenantShare("default")]


class Comparison:
    """Runs `bench` (its workload, rates, SLO) against each system and finds the rate at
    which each reaches `target` attainment."""

    def __init__(
        self, bench: BenchConfig, spec: ServiceSpec, systems: tuple[str, ...] = SYSTEMS,
        target: float = 0.8,
    ) -> None:
        bad = [s for s in systems if s not in SYSTEMS]
        if bad:
            raise ValueError(f"unknown systems {bad}; choose from {SYSTEMS}")
        if spec.pads and "shape-only" in systems:
            why = "--padded" if spec.padded else "--execution graphs"
            raise ValueError(f"with {why} every system pads to the shape buckets, so "
                             "shape-only is fcfs: leave it out of --systems")
        if not spec.pads and "fcfs-fit" in systems:
            raise ValueError("fcfs-fit differs from fcfs only in padded batches: add --padded "
                             "or --execution graphs, or leave it out of --systems")
        if not bench.rates:
            raise ValueError("the comparison sweeps request rates: give --rates")
        self.bench = bench
        self.spec = spec
        self.systems = systems
        self.target = target
        self.settle_timeout_s = 2 * bench.timeout_s + 60
        self.benches: dict[str, Bench] = {}

    def run(self) -> dict[str, Any]:
        """Every system is started first; then each rate is offered to each system in turn
        (the order rotating per rate), so noise from a shared machine spreads over all, and
        each run waits until no service is still busy with an earlier one."""
        benches = self.benches
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in self.systems}
        with contextlib.ExitStack() as stack:
            tokenizer = None
            for name in self.systems:
                controller, tenants, mix = system_setup(name, self.spec)
                service = stack.enter_context(
                    ServiceHarness(controller, tenants, self.spec.start_timeout_s)
                )
                config = dataclasses.replace(
                    self.bench, backend="grpc", target=service.target, tenants=mix,
                    metrics_url=service.http_url + "/metrics",
                )
                benches[name] = Bench(config, tokenizer)
                tokenizer = benches[name].tokenizer
            for i, rate in enumerate(self.bench.rates):
                order = self.systems[i % len(self.systems):] + self.systems[: i % len(self.systems)]
                for name in order:
                    settled = self._settle()
                    run = benches[name].run_rates([rate])["runs"][0]
                    runs[name].append({**run, "settled": settled})
        results = {
            name: benches[name].result(runs[name]) for name in self.systems
        }
        out = {"systems": results, "rate_at_target": self._rates(results, "slo_attainment")}
        if self.bench.slo.per_kind:  # the same runs, judged by the base targets alone
            out["rate_at_target_uniform"] = self._rates(results, "uniform_slo_attainment")
        return out

    def _settle(self) -> dict[str, list[float]]:
        """Wait until no service holds work from an earlier run (a client gives up on a
        request at its timeout, a server may still be finishing its batch): every run
        starts on idle cores. Returns, per system that was busy, [requests, seconds]."""
        settled = {}
        for name, bench in self.benches.items():
            busy, waited = ServerMetrics(bench.config.metrics_url).wait_idle(self.settle_timeout_s)
            if busy:
                settled[name] = [busy, round(waited, 2)]
        return settled

    def _rates(self, results: dict[str, Any], key: str) -> dict[str, Any]:
        found = {}
        for name, result in results.items():
            runs = result["runs"]
            rate, how = rate_at_attainment(
                [r["rate"] for r in runs], [r["summary"][key] for r in runs], self.target
            )
            found[name] = {"rate": rate, "how": how}
        base = found.get("bucketserve", {}).get("rate")
        ratios = {
            f"bucketserve/{name}": (base / f["rate"] if base and f["rate"] else None)
            for name, f in found.items() if name != "bucketserve"
        }
        return {"target": self.target, "systems": found, "ratios": ratios}
