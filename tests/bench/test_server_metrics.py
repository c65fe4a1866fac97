"""Parsing the server's /metrics exposition and the before/after difference."""

from __future__ import annotations

import http.server
import threading

import pytest

from bucketserve.bench.server_metrics import ServerMetrics, diff, parse

BEFORE = """\
# TYPE bucketserve:graph_misses counter
bucketserve:graph_misses_total{role="prefill",worker="prefill-0"} 2.0
bucketserve:graph_misses_total{role="decode",worker="decode-0"} 1.0
# TYPE bucketserve:num_preemptions counter
bucketserve:num_preemptions_total 4.0
# TYPE bucketserve:padding_waste_ratio gauge
bucketserve:padding_waste_ratio 0.25
# TYPE bucketserve:generation_tokens counter
bucketserve:generation_tokens_total{model_name="m",tenant="a"} 10.0
bucketserve:generation_tokens_total{model_name="m",tenant="b"} 5.0
# TYPE bucketserve:prefill_batch_tokens counter
bucketserve:prefill_batch_tokens_total 100.0
# TYPE bucketserve:prefill_computed_tokens counter
bucketserve:prefill_computed_tokens_total 90.0
# TYPE bucketserve:prefill_padded_tokens counter
bucketserve:prefill_padded_tokens_total 100.0
# TYPE bucketserve:unrelated gauge
bucketserve:unrelated 9.0
"""
AFTER = BEFORE.replace("} 2.0", "} 5.0").replace("total 4.0", "total 6.0").replace(
    "ratio 0.25", "ratio 0.125"
).replace('"b"} 5.0', '"b"} 25.0').replace(
    "batch_tokens_total 100.0", "batch_tokens_total 400.0"
).replace("padded_tokens_total 100.0", "padded_tokens_total 600.0").replace(
    "computed_tokens_total 90.0", "computed_tokens_total 390.0"
)


def test_counters_are_summed_over_labels_and_differenced() -> None:
    before, after = parse(BEFORE), parse(AFTER)
    assert before == {
        "graph_misses": 3.0,
        "preemptions": 4.0,
        "padding_waste_ratio": 0.25,
        "generation_tokens": 15.0,
        "prefill_batch_tokens": 100.0,
        "prefill_computed_tokens": 90.0,
        "prefill_padded_tokens": 100.0,
    }
    assert diff(before, after) == {
        "graph_misses": 3.0,
        "preemptions": 2.0,
        "padding_waste_ratio": 0.125,  # a gauge: its value after the run
        "generation_tokens": 20.0,
        "prefill_batch_tokens": 300.0,
        "prefill_computed_tokens": 300.0,
        "prefill_padded_tokens": 500.0,
        "prefill_padding_share": pytest.approx(0.4),  # the run's 200 padding of 500
    }


class _Exposition:
    """A /metrics endpoint on loopback that serves `pages` in turn (the last one for good)."""

    def __init__(self, pages: list[str]) -> None:
        pages = list(pages)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = (pages.pop(0) if len(pages) > 1 else pages[0]).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"


def load(running: int, waiting: int) -> str:
    return (
        "# TYPE bucketserve:num_requests_running gauge\n"
        f"bucketserve:num_requests_running{{model_name=\"m\"}} {running}.0\n"
        "# TYPE bucketserve:num_requests_waiting gauge\n"
        f"bucketserve:num_requests_waiting{{model_name=\"m\"}} {waiting}.0\n"
    )


def test_wait_idle_polls_until_nothing_runs_or_waits() -> None:
    endpoint = _Exposition([load(2, 3), load(1, 0), load(0, 0)])
    try:
        busy, waited = ServerMetrics(endpoint.url).wait_idle(10.0, poll_s=0.01)
        assert busy == 5 and waited > 0
        assert ServerMetrics(endpoint.url).wait_idle(10.0)[0] == 0  # idle now: no wait
    finally:
        endpoint.server.shutdown()


def test_wait_idle_gives_up_on_a_server_that_stays_busy() -> None:
    endpoint = _Exposition([load(1, 0)])
    try:
        with pytest.raises(TimeoutError, match=r"1 requests still in flight after 0\.05 s"):
            ServerMetrics(endpoint.url).wait_idle(0.05, poll_s=0.01)
    finally:
        endpoint.server.shutdown()


def test_tenant_cache_figures_and_sheds_are_kept_per_tenant() -> None:
    page = """\
# TYPE bucketserve:prefix_cache_tenant_queries counter
bucketserve:prefix_cache_tenant_queries_total{tenant="chat"} QC
bucketserve:prefix_cache_tenant_queries_total{tenant="noisy"} 900.0
# TYPE bucketserve:prefix_cache_tenant_hits counter
bucketserve:prefix_cache_tenant_hits_total{tenant="chat"} HC
# TYPE bucketserve:requests_shed counter
bucketserve:requests_shed_total{tenant="chat"} SC
"""
    before = parse(page.replace("QC", "100.0").replace("HC", "50.0").replace("SC", "1.0"))
    after = parse(page.replace("QC", "500.0").replace("HC", "350.0").replace("SC", "4.0"))
    delta = diff(before, after)
    assert delta["cache_queries:chat"] == 400.0 and delta["cache_hits:chat"] == 300.0
    assert delta["cache_hit_rate:chat"] == pytest.approx(0.75)
    assert delta["shed:chat"] == 3.0 and "cache_hit_rate:noisy" not in delta
