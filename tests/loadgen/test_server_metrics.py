"""Parsing the server's /metrics exposition and the before/after difference."""

from __future__ import annotations

from benchmarks.loadgen.server_metrics import diff, parse

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
# TYPE bucketserve:unrelated gauge
bucketserve:unrelated 9.0
"""
AFTER = BEFORE.replace("} 2.0", "} 5.0").replace("total 4.0", "total 6.0").replace(
    "ratio 0.25", "ratio 0.125"
).replace('"b"} 5.0', '"b"} 25.0')


def test_counters_are_summed_over_labels_and_differenced() -> None:
    before, after = parse(BEFORE), parse(AFTER)
    assert before == {
        "graph_misses": 3.0,
        "preemptions": 4.0,
        "padding_waste_ratio": 0.25,
        "generation_tokens": 15.0,
    }
    assert diff(before, after) == {
        "graph_misses": 3.0,
        "preemptions": 2.0,
        "padding_waste_ratio": 0.125,  # a gauge: its value after the run
        "generation_tokens": 20.0,
    }
