"""benchmarks/soak.py's pieces on a 6-second toy run against the in-process gateway (no
faults: those need worker processes): every request ends typed, nothing is lost or leaked,
every malformed request is refused as invalid, and the table says so."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from benchmarks.soak import Soak, SoakConfig, table
from benchmarks.soak_traffic import Traffic


@pytest.mark.slow
def test_a_toy_soak_loses_nothing_and_refuses_every_malformed_request(open_server: Any) -> None:
    config = SoakConfig(minutes=6 / 60, rate=3.0, cancel_fraction=0.3, max_tokens=16,
                        fault_every_s=6.0, faults=False, seed=1, drain_s=60.0, stall_s=120.0)
    traffic = Traffic(open_server.grpc_target, open_server.http_url, open_server.model_name,
                      stall_s=config.stall_s)
    report = asyncio.run(Soak(config, traffic, None, open_server.http_url).run())
    requests = report["requests"]
    assert requests["sent"] >= 10 and requests["lost"] == 0, report["lost"]
    assert requests["admitted"] == requests["sent"] and not requests["rejected"]
    assert requests["finished"] >= 1 and requests["cancelled_by_client"] >= 1
    assert requests["finished"] + requests["cancelled_by_client"] == requests["sent"]
    assert all(report["by_protocol"][p]["sent"] for p in ("http", "grpc"))
    assert report["ttft_s"]["p99"] is not None
    malformed = report["malformed"]
    assert malformed["sent"] == 20 and malformed["answers"] == {"invalid": 20}
    drained = report["after_drain"]
    assert drained["drained_in_time"] and drained["kv_blocks_leaked"] == 0
    assert set(report["server"]["rejected_by_code"]) == {"INVALID_ARGUMENT"}
    assert "goal            0 lost, 0 leaked, every failure typed, every fault recovered: MET" \
        in table(report)
