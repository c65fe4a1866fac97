"""Prometheus metrics with vLLM's names under `bucketserve:`, in a registry per server.

Request histograms and token counters are recorded as requests end; queue,
KV-cache, bucket and padding figures are read from the backend's stats() at
scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from bucketserve.gateway.generation import Generation

# vLLM's histogram buckets
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5)
LATENCY_BUCKETS = (*TOKEN_BUCKETS, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0)
REQUEST_BUCKETS += (60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
P = "bucketserve:"


class GatewayMetrics:
    def __init__(self, model_name: str, stats: Callable[[], Any] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._slo: dict[str, list[int]] = {}  # tenant -> [attained, judged]
        names = ["model_name"]
        tenant = ["model_name", "tenant"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(P + name, doc, names, buckets=buckets, registry=self.registry)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(P + name, doc, labels, registry=self.registry)

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS
        )
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency.", TOKEN_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_BUCKETS
        )
        self.queue = histogram(
            "request_queue_time_seconds", "Time waiting for a prefill batch.", REQUEST_BUCKETS
        )
        self.prefill = histogram(
            "request_prefill_time_seconds", "Prefill batch compute time.", REQUEST_BUCKETS
        )
        self.transfer = histogram(
            "request_kv_transfer_time_seconds", "KV block transfer time.", REQUEST_BUCKETS
        )
        self.decode = histogram("request_decode_time_seconds", "Decode time.", REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.", tenant)
        self.generation_tokens = counter("generation_tokens", "Generated tokens.", tenant)
        self.success = counter(
            "request_success", "Requests ended, by finish reason.", [*names, "finished_reason"]
        )
        self.rejected = counter("request_rejected", "Requests refused at admission.", ["code"])
        for metric in (self.ttft, self.itl, self.e2e, self.queue, self.prefill, self.transfer,
                       self.decode):
            metric.labels(model_name)  # exported at zero before the first request
        self.registry.register(_ServiceCollector(self, stats))

    def exposition(self) -> bytes:
        """The text format a Prometheus scrape of /metrics gets."""
        return generate_latest(self.registry)

    def record_rejection(self, code: str) -> None:
        self.rejected.labels(code).inc()

    def record(self, gen: Generation, end_time: float) -> None:
        """A request ended (finished, cancelled or failed); `end_time` is time.monotonic()."""
        name, request = self.model_name, gen.request
        final = gen.final
        reason = final.finish_reason if final is not None else "cancelled"
        self.success.labels(name, reason or "error").inc()
        self.e2e.labels(name).observe(end_time - request.arrival_time)
        self.generation_tokens.labels(name, gen.tenant.name).inc(gen.num_output_tokens)
        for gap in gen.token_gaps:
            self.itl.labels(name).observe(gap)
        ttft = None
        if gen.first_token_time is not None:
            ttft = gen.first_token_time - request.arrival_time
            self.ttft.labels(name).observe(ttft)
        if final is None:
            return
        self.prompt_tokens.labels(name, gen.tenant.name).inc(final.num_prompt_tokens)
        if final.timings is not None:
            self.queue.labels(name).observe(final.timings.queue_s)
            self.prefill.labels(name).observe(final.timings.prefill_s)
            self.transfer.labels(name).observe(final.timings.transfer_s)
            self.decode.labels(name).observe(final.timings.decode_s)
        if reason != "cancelled":
            self._judge_slo(gen, ttft, reason == "error")

    def _judge_slo(self, gen: Generation, ttft: float | None, failed: bool) -> None:
        ttft_target = gen.request.slo_ttft_s or gen.tenant.ttft_slo_s
        tpot_target = gen.request.slo_tpot_s or gen.tenant.tpot_slo_s
        if ttft_target is None and tpot_target is None:
            return
        tpot = sum(gen.token_gaps) / len(gen.token_gaps) if gen.token_gaps else 0.0
        met = not failed and ttft is not None
        met = met and (ttft_target is None or ttft <= ttft_target)
        met = met and (tpot_target is None or tpot <= tpot_target)
        counts = self._slo.setdefault(gen.tenant.name, [0, 0])
        counts[0] += met
        counts[1] += 1

    def slo_attainment(self) -> dict[str, float]:
        """Per tenant, the share of its judged requests that met their TTFT and TPOT targets."""
        return {tenant: met / judged for tenant, (met, judged) in self._slo.items()}


class _ServiceCollector(Collector):
    """Reads the backend's stats() at each scrape."""

    def __init__(self, metrics: GatewayMetrics, stats: Callable[[], Any] | None) -> None:
        self.metrics = metrics
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        slo = GaugeMetricFamily(
            P + "slo_attainment", "Share of requests meeting their SLO targets.", labels=["tenant"]
        )
        for tenant, share in sorted(self.metrics.slo_attainment().items()):
            slo.add_metric([tenant], share)
        yield slo
        if self.stats is not None:
            yield from _service_metrics(self.stats())


def _counts(name: str, doc: str, label: str, counts: dict[str, int]) -> CounterMetricFamily:
    """A counter with one label, a sample per key of `counts`."""
    family = CounterMetricFamily(P + name, doc, labels=[label])
    for key, n in sorted(counts.items()):
        family.add_metric([key], n)
    return family


def _tenant_cache_metrics(workers: list[Any]) -> Iterator[Metric]:
    """Each tenant's prefix-cache figures, summed over the workers' pools."""
    totals: dict[str, list[int]] = {}
    for w in workers:
        for tenant, s in w.tenant_cache.items():
            sums = totals.setdefault(tenant, [0, 0, 0, 0])
            for i, value in enumerate((s.cached_blocks, s.queries, s.hits, s.evictions)):
                sums[i] += value
    families = (
        GaugeMetricFamily(
            P + "prefix_cache_tenant_blocks",
            "Cached KV blocks a tenant's requests named, still cached.", labels=["tenant"],
        ),
        CounterMetricFamily(
            P + "prefix_cache_tenant_queries",
            "Prompt tokens of a tenant looked up in the prefix caches.", labels=["tenant"],
        ),
        CounterMetricFamily(
            P + "prefix_cache_tenant_hits",
            "Prompt tokens of a tenant found in the prefix caches (its own domain only).",
            labels=["tenant"],
        ),
        CounterMetricFamily(
            P + "prefix_cache_tenant_evictions",
            "Cached blocks a tenant named, evicted to make room (its cache_share decides "
            "whose go first).",
            labels=["tenant"],
        ),
    )  # fmt: skip
    for tenant, sums in sorted(totals.items()):
        for family, value in zip(families, sums, strict=True):
            family.add_metric([tenant], value)
    yield from families


def _service_metrics(stats: Any) -> Iterator[Metric]:
    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(P + name, doc, value=value)

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(P + name, doc, value=value)

    workers, buckets = list(stats.workers), stats.buckets
    yield gauge("num_requests_running", "Requests decoding.", stats.running)
    yield gauge("num_requests_waiting", "Requests waiting for prefill.", stats.waiting)
    usage = GaugeMetricFamily(
        P + "kv_cache_usage_perc", "KV-cache usage, 1 = full.", labels=["worker", "role"]
    )
    blocks_used = GaugeMetricFamily(
        P + "kv_cache_blocks_used", "KV blocks not free (0 once drained).",
        labels=["worker", "role"],
    )
    misses = CounterMetricFamily(
        P + "graph_misses", "Batches beyond the largest warmed shape.", labels=["worker", "role"]
    )
    bubble = GaugeMetricFamily(
        P + "pipeline_bubble_fraction",
        "Share of stage time idle while the worker's stage group had work, since start.",
        labels=["worker", "role"],
    )
    in_flight = GaugeMetricFamily(
        P + "pipeline_microbatches_in_flight",
        "Microbatches in the worker's stage group now.",
        labels=["worker", "role"],
    )
    hit_rate = GaugeMetricFamily(
        P + "prefix_cache_hit_rate",
        "Share of the prompt tokens the worker looked up that its prefix cache held, since "
        "it started.",
        labels=["worker", "role"],
    )
    compile_s = GaugeMetricFamily(
        P + "graph_compile_seconds",
        "Seconds spent compiling step graphs (graphs mode): at warm-up, and for shapes "
        "first met while serving (misses).",
        labels=["worker", "role", "phase"],
    )
    for w in workers:
        used = 1.0 - w.num_free_blocks / w.num_total_blocks if w.num_total_blocks else 0.0
        usage.add_metric([w.name, w.role], used)
        blocks_used.add_metric([w.name, w.role], w.num_total_blocks - w.num_free_blocks)
        misses.add_metric([w.name, w.role], w.graph_misses)
        bubble.add_metric([w.name, w.role], w.bubble_fraction)
        in_flight.add_metric([w.name, w.role], w.microbatches_in_flight)
        queries = w.prefix_cache_queries
        hit_rate.add_metric([w.name, w.role], w.prefix_cache_hits / queries if queries else 0.0)
        compile_s.add_metric([w.name, w.role, "warmup"], w.graph_compile_s)
        compile_s.add_metric([w.name, w.role, "miss"], w.graph_miss_compile_s)
    yield usage
    yield blocks_used
    yield misses
    yield bubble
    yield in_flight
    yield hit_rate
    yield compile_s
    yield counter(
        "num_preemptions", "Sequences preempted.", sum(w.preemptions for w in workers)
    )
    yield counter(
        "prefix_cache_queries",
        "Prompt tokens looked up in the workers' prefix caches.",
        sum(w.prefix_cache_queries for w in workers),
    )
    yield counter(
        "prefix_cache_hits",
        "Prompt tokens found in the workers' prefix caches.",
        sum(w.prefix_cache_hits for w in workers),
    )
    yield from _tenant_cache_metrics(workers)
    yield _counts(
        "requests_shed",
        "Requests refused at once (429) because the queue ahead would make them miss their "
        "TTFT target (tenants with shed: predicted).",
        "tenant", stats.requests_shed,
    )  # fmt: skip
    yield _counts(
        "prefill_path_requests",
        "Requests prefilled by their decode worker (local) or a prefill worker (remote), "
        "each prefill counted (controller.remote_prefill).",
        "path", stats.prefill_paths,
    )  # fmt: skip
    yield counter(
        "slo_admission_holds",
        "Decode steps that held a new prompt back to keep running requests' TPOT targets.",
        sum(w.slo_holds for w in workers),
    )
    yield counter(
        "decode_paced_seconds",
        "Seconds decode steps waited, under their TPOT targets, for a prefill on shared cores.",
        sum(w.paced_s for w in workers),
    )
    waste = buckets.mean_waste_ratio
    yield gauge("padding_waste_ratio", "Mean padding waste of prefill batches (Eq. 2).", waste)
    yield counter(
        "prefill_batch_tokens", "Prompt tokens of formed prefill batches.", buckets.prompt_tokens
    )
    yield counter(
        "prefill_computed_tokens",
        "Prompt tokens of formed prefill batches less the cached prefixes they skip.",
        buckets.computed_tokens,
    )
    yield counter(
        "prefill_padded_tokens",
        "Tokens prefill batches run, padding to their shapes included.",
        buckets.padded_tokens,
    )
    yield gauge("request_buckets", "Request buckets now.", buckets.num_buckets)
    yield counter("bucket_splits", "Request bucket splits.", buckets.splits)
    yield counter("bucket_merges", "Request bucket merges.", buckets.merges)
