"""`bucketserve bench` flags that need no server: per-kind SLO targets, --padded, --aggregate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bucketserve.bench.cli import build_config, run
from bucketserve.cli import build_parser


def parse(*argv: str):
    return build_parser().parse_args(["bench", "--rate", "1", *argv])


def test_slo_kind_sets_one_kinds_targets() -> None:
    config = build_config(parse("--slo-ttft", "4", "--slo-tpot", "0.25",
                                "--slo-kind", "long=20,0.5"))
    assert (config.slo.ttft_s, config.slo.tpot_s) == (4.0, 0.25)
    assert dict(config.slo.per_kind) == {"long": (20.0, 0.5)}


def test_bad_slo_kind_and_padded_shape_only_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse("--slo-kind", "long=20")
    assert exc.value.code == 2
    assert "KIND=TTFT,TPOT" in capsys.readouterr().err
    assert run(parse("--slo-kind", "offline=20,0.5")) == 2
    assert "per-kind SLO targets are for the kinds" in capsys.readouterr().err
    assert run(parse("--compare", "--padded", "--systems", "bucketserve,shape-only")) == 2
    assert "shape-only is fcfs" in capsys.readouterr().err


def comparison(a: float, b: float) -> dict:
    def target(ra: float, rb: float) -> dict:
        return {"target": 0.8,
                "systems": {"bucketserve": {"rate": ra, "how": "interpolated"},
                            "fcfs": {"rate": rb, "how": "interpolated"}},
                "ratios": {"bucketserve/fcfs": ra / rb}}

    def runs(slo: float, admitted: float | None) -> dict:
        summary = {"slo_attainment": slo, "admitted_slo_attainment": admitted,
                   "goodput": 2 * slo, "ttft": {"p90": slo}}
        return {"runs": [{"rate": 2.0, "summary": summary}]}

    return {"systems": {"bucketserve": runs(a / 4, a / 5), "fcfs": runs(b / 4, None)},
            "rate_at_target": target(a, b), "rate_at_target_uniform": target(a / 2, b)}


def test_aggregate_reports_medians_under_both_judgements(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for i, (a, b) in enumerate([(3.0, 2.0), (2.0, 2.0), (4.0, 2.0)]):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(comparison(a, b)))
    assert run(build_parser().parse_args(["bench", "--aggregate", *map(str, paths)])) == 0
    out = capsys.readouterr().out
    per_kind, uniform = out.split("judged by the base targets")
    assert "bucketserve  median 3.000" in per_kind
    assert "bucketserve/fcfs         median 1.500x  runs [1.50, 1.00, 2.00]" in per_kind
    assert "bucketserve/fcfs         median 0.750x  runs [0.75, 0.50, 1.00]" in uniform
    # per system and rate: the medians of the runs' summaries (admitted: where refused)
    assert ("bucketserve       2  SLO 0.750, admitted 0.600, goodput 1.500, TTFT p90 750"
            in uniform)
    assert "fcfs              2  SLO 0.500, goodput 1.000, TTFT p90 500" in uniform
