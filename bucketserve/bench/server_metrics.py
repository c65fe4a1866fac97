"""The server's own figures from its Prometheus endpoint, scraped before and after a run."""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# sample name (labels summed) -> report key; counters are reported as after - before
COUNTERS = {
    "bucketserve:graph_misses_total": "graph_misses",
    "bucketserve:num_preemptions_total": "preemptions",
    "bucketserve:bucket_splits_total": "bucket_splits",
    "bucketserve:bucket_merges_total": "bucket_merges",
    "bucketserve:prompt_tokens_total": "prompt_tokens",
    "bucketserve:generation_tokens_total": "generation_tokens",
    "bucketserve:prefill_batch_tokens_total": "prefill_batch_tokens",
    "bucketserve:prefill_computed_tokens_total": "prefill_computed_tokens",
    "bucketserve:prefill_padded_tokens_total": "prefill_padded_tokens",
    "bucketserve:decode_paced_seconds_total": "decode_paced_s",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
}
# per label value: sample name -> (report key, label), reported as `key:value` (counters,
# after - before)
BY_LABEL = {
    "bucketserve:prefix_cache_tenant_queries_total": ("cache_queries", "tenant"),
    "bucketserve:prefix_cache_tenant_hits_total": ("cache_hits", "tenant"),
    "bucketserve:prefix_cache_tenant_evictions_total": ("cache_evictions", "tenant"),
    "bucketserve:requests_shed_total": ("shed", "tenant"),
    "bucketserve:prefill_path_requests_total": ("prefill_path", "path"),
}
GAUGES = {
    "bucketserve:padding_waste_ratio": "padding_waste_ratio",
    "bucketserve:request_buckets": "request_buckets",
    "bucketserve:num_requests_running": "requests_running",
    "bucketserve:num_requests_waiting": "requests_waiting",
    "vllm:num_requests_running": "requests_running",
    "vllm:num_requests_waiting": "requests_waiting",
}


class ServerMetrics:
    """Scrapes `url`; `delta()` is the change since `start()` (None values: not exported)."""

    def __init__(self, url: str | None, timeout_s: float = 5.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.before: dict[str, float] = {}

    def scrape(self) -> dict[str, float]:
        if not self.url:
            return {}
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:
            return parse(response.read().decode())

    def start(self) -> None:
        self.before = self.scrape()

    def delta(self) -> dict[str, float]:
        return diff(self.before, self.scrape())

    def in_flight(self) -> int:
        """Requests the server still runs or queues (0 when it exports no such gauge)."""
        now = self.scrape()
        return int(now.get("requests_running", 0) + now.get("requests_waiting", 0))

    def wait_idle(self, timeout_s: float, poll_s: float = 0.2) -> tuple[int, float]:
        """Wait until nothing is in flight; (requests in flight at the call, seconds waited).
        Raises TimeoutError when the server is still busy after `timeout_s`."""
        start = time.monotonic()
        busy = first = self.in_flight()
        while busy:
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{self.url}: {busy} requests still in flight after "
                                   f"{timeout_s:g} s")
            time.sleep(poll_s)
            busy = self.in_flight()
        return first, time.monotonic() - start


def parse(text: str) -> dict[str, float]:
    """Report key -> value (summed over label sets) for the samples we know."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = COUNTERS.get(sample.name) or GAUGES.get(sample.name)
            if sample.name in BY_LABEL:
                name, label = BY_LABEL[sample.name]
                key = f"{name}:{sample.labels.get(label, '')}"
            if key is not None:
                out[key] = out.get(key, 0.0) + sample.value
    return out


def diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters as after - before, gauges as after."""
    gauges = set(GAUGES.values())
    out = {
        key: value if key in gauges else value - before.get(key, 0.0)
        for key, value in after.items()
    }
    padded = out.get("prefill_padded_tokens")
    if padded:  # the run's share of prefill compute spent on padding (cached prefixes skipped)
        out["prefill_padding_share"] = 1 - out.get("prefill_computed_tokens", padded) / padded
    for key in [k for k in out if k.startswith("cache_queries:")]:
        tenant = key.partition(":")[2]
        if out[key]:  # the run's prefix-cache hit rate of the tenant's prompt tokens
            out[f"cache_hit_rate:{tenant}"] = out.get(f"cache_hits:{tenant}", 0.0) / out[key]
    return out
