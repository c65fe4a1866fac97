"""Conditional disaggregation: `PDScheduler.route` sends each request of a batch to a
prefill worker or lets its decode worker prefill it, by the rule of `PathCosts` under
scripted loads; the service gives the engine's greedy tokens on every path (local mode),
counts each request's path in its metrics and access log, and `always` / `never` reproduce
the fixed shapes."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from bucketserve.bucket_manager import BucketRequest, PrefillBatch
from bucketserve.controller.controller import Controller
from bucketserve.controller.pd_scheduler import PathCosts, PDScheduler
from bucketserve.gateway.metrics import _service_metrics
from tests.disagg.helpers import IdleHandle, controller_config, dispatch, queue, serve_and_drain

MS = 1e-3


def batch(*lengths: int) -> PrefillBatch:
    requests = tuple(BucketRequest(f"r{i}", n, 8) for i, n in enumerate(lengths))
    return PrefillBatch(
        batch_id=0, tenant="default", requests=requests, bucket=(0, 4096),
        shape=(len(lengths), max(lengths), 0), graph_miss=False,
        kv_blocks_per_request=tuple(1 for _ in lengths), block_size=16, waste_ratio=0.0,
        padded_waste=0.0, shape_waste=0.0, padded_tokens=sum(lengths),
        order_keys=tuple((i,) for i in range(len(lengths))),
    )  # fmt: skip


def ids(part: PrefillBatch | None) -> list[str]:
    return [] if part is None else [r.request_id for r in part.requests]


# a prefill worker and a decode worker of the same speed, KV moving layer by layer, a
# handoff's calls taking 10 ms
COSTS = PathCosts(
    prefill_token_s=0.1 * MS, decode_token_s=0.1 * MS, decode_step_s=2 * MS,
    transfer_token_s=0.05 * MS, num_layers=32, step_tokens=512, handoff_s=10 * MS,
)  # fmt: skip


def costs(**changes: float) -> PathCosts:
    return PathCosts(**{**COSTS.__dict__, **changes})


def test_always_and_never_send_everything_one_way() -> None:
    pd, b = PDScheduler(1, 16), batch(10, 3000)
    assert [ids(p) for p in pd.route(b, COSTS, "always")] == [[], ["r0", "r1"]]
    assert [ids(p) for p in pd.route(b, COSTS, "never")] == [["r0", "r1"], []]


def test_auto_goes_local_when_no_prefill_worker_is_open_and_remote_until_measured() -> None:
    pd, b = PDScheduler(1, 16), batch(10, 3000)
    closed = PathCosts(prefill_token_s=None, prefill_open=False)
    assert [ids(p) for p in pd.route(b, closed, "auto")] == [["r0", "r1"], []]
    cold = PathCosts(prefill_token_s=None)
    assert [ids(p) for p in pd.route(b, cold, "auto")] == [[], ["r0", "r1"]]


def test_auto_prices_each_request_on_both_paths() -> None:
    """An idle decode worker prefills short and long prompts itself (no transfer, no
    handoff, nobody waiting); with 40 requests decoding there each token it prefills
    delays all 40, so prompts go remote; with a prefill side 100k tokens behind they come
    back; with 4 decoding, the short prompt stays and the long one goes."""
    pd, b = PDScheduler(1, 16), batch(16, 2000)
    assert [ids(p) for p in pd.route(b, COSTS, "auto")] == [["r0", "r1"], []]
    busy = costs(decode_running=40)
    assert [ids(p) for p in pd.route(b, busy, "auto")] == [[], ["r0", "r1"]]
    behind = costs(decode_running=40, prefill_backlog_tokens=100_000)
    assert [ids(p) for p in pd.route(b, behind, "auto")] == [["r0", "r1"], []]
    some = costs(decode_running=4)
    assert some.local_s(16, 0) == pytest.approx(16 * 0.1 * MS + 2 * MS + 4 * 16 * 0.1 * MS)
    assert some.remote_s(16, 0) == pytest.approx(16 * 0.1 * MS + 16 * 0.05 * MS / 32 + 10 * MS)
    assert [ids(p) for p in pd.route(b, some, "auto")] == [["r0"], ["r1"]]


def test_a_busy_prefill_side_gets_what_is_cheaper_there_even_behind_its_queue() -> None:
    """No prefill slot open, 4,000 tokens queued there, 40 decoding: a 16-token prompt
    stays local (67.6 ms against 412 ms), a 2,000-token one, which would stall all 40 for
    0.2 s, is returned remote for the dispatcher to hold until a slot opens; before any
    measurement everything goes local."""
    pd = PDScheduler(1, 16)
    closed = costs(prefill_open=False, decode_running=40, prefill_backlog_tokens=4000)
    assert closed.local_s(16, 0) == pytest.approx(16 * 0.1 * MS + 2 * MS + 40 * 16 * 0.1 * MS)
    remote_s = 4016 * 0.1 * MS + 16 * 0.05 * MS / 32 + 10 * MS
    assert closed.remote_s(16, 4000) == pytest.approx(remote_s)
    local, remote = pd.route(batch(16, 2000), closed, "auto")
    assert (ids(local), ids(remote)) == (["r0"], ["r1"])
    unmeasured = costs(prefill_open=False, prefill_token_s=None, decode_running=40)
    assert [ids(p) for p in pd.route(batch(16, 2000), unmeasured, "auto")] == [["r0", "r1"], []]


def test_the_dispatcher_holds_for_a_prefill_slot_what_is_cheaper_remote(
    tiny_model_dir: Path,
) -> None:
    """Both prefill slots taken and 4,000 tokens queued there, 40 requests decoding: an
    8-token prompt is prefilled locally now, a 300-token one stays queued in the bucket
    manager; once a slot opens it goes to the prefill worker."""
    config = controller_config(
        tiny_model_dir, mode="local", topology="disaggregated", remote_prefill="auto"
    )
    c = Controller(config)
    prefill, decode = IdleHandle("prefill-0", 256, "prefill"), IdleHandle("decode-0", 256)
    for handle in (prefill, decode):
        handle.stats.prefill_token_s = 0.1 * MS
    decode.stats.decode_step_s, decode.stats.running = 2 * MS, 40
    prefill.inflight = config.prefill.max_batches
    c.pool.handles = [prefill, decode]
    c.dispatcher.pd.prefill_sent("prefill-0", 4000 // config.runner.block_size)
    short, long = queue(c, "short", [5] * 8), queue(c, "long", [6] * 300)
    dispatch(c)
    assert (short.decode_worker, short.prefill_path) == ("decode-0", "local")
    assert long.prefill_path is None and "long" in c.buckets._entries
    prefill.inflight = 0
    dispatch(c)
    assert long.prefill_path == "remote" and "long" not in c.buckets._entries


def test_the_transfer_counts_whole_unless_it_is_layer_wise() -> None:
    """A slow link: 2000 tokens take 2 s to move whole, 1/32 of that layer by layer."""
    slow = costs(transfer_token_s=1 * MS, decode_running=4)
    whole = costs(transfer_token_s=1 * MS, decode_running=4, layerwise=False)
    assert slow.remote_s(2000, 0) == pytest.approx(0.2 + 2.0 / 32 + 10 * MS)
    assert whole.remote_s(2000, 0) == pytest.approx(0.2 + 2.0 + 10 * MS)
    assert ids(PDScheduler(1, 16).route(batch(2000), slow, "auto")[1]) == ["r0"]
    assert ids(PDScheduler(1, 16).route(batch(2000), whole, "auto")[0]) == ["r0"]


def test_requests_of_one_batch_queue_behind_each_other_on_their_path() -> None:
    """Each request taken adds its tokens to its path's backlog: 6 prompts of 600 tokens
    on an idle pair of equal costs alternate between the two sides."""
    pd = PDScheduler(1, 16)
    even = costs(transfer_token_s=0.0, handoff_s=0.0)
    local, remote = pd.route(batch(*[600] * 6), even, "auto")
    assert (ids(local), ids(remote)) == (["r0", "r2", "r4"], ["r1", "r3", "r5"])


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_every_path_gives_the_engines_tokens_and_is_counted(
    mode: str, tiny_model_dir: Path, work: list, reference: list,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.INFO, logger="bucketserve.gateway.access_log")
    config = controller_config(tiny_model_dir, mode="local", remote_prefill=mode)

    async def main() -> tuple[list, object]:
        controller = Controller(config)
        await controller.start()
        return await serve_and_drain(controller, work, mode)

    outputs, stats = asyncio.run(main())
    assert outputs == reference
    paths = stats.prefill_paths
    assert sum(paths.values()) == len(work)
    prefill = stats.worker("prefill-0")
    if mode == "never":
        assert paths == {"local": len(work)} and prefill.batches == 0 and not stats.transfers
    if mode == "always":
        assert paths == {"remote": len(work)} and prefill.batches > 0
    text = "\n".join(str(m) for m in _service_metrics(stats))
    assert "bucketserve:prefill_path_requests" in text


@pytest.mark.parametrize("after", [0, 1, 2])
def test_a_prefill_failing_at_any_layer_of_a_handoff_loses_nothing_and_leaks_nothing(
    after: int, tiny_model_dir: Path, work: list, reference: list,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The tiny model has 2 layers, which reach the decode worker's blocks one by one
    (in-process transport): the first batch fails before any, after one, or after both;
    its reservation is given back (lease released in any state), the batch re-prefilled,
    and every output is the engine's, every block free again."""

    from bucketserve.controller.worker_pool import WorkerPool

    built = WorkerPool.prefill_config
    monkeypatch.setattr(
        WorkerPool, "prefill_config",
        lambda self, i: built(self, i).model_copy(update={"exit_after_layers": after}),
    )  # fmt: skip
    config = controller_config(tiny_model_dir, mode="local")

    async def main() -> tuple[list, object]:
        controller = Controller(config)
        await controller.start()
        return await serve_and_drain(controller, work, f"drill-{after}")

    outputs, stats = asyncio.run(main())
    assert outputs == reference
    assert f"fault drill, the batch fails after {after} layers" in caplog.text
    decode = stats.worker("decode-0")
    assert decode.leases_open == 0 and decode.reserved_blocks == 0
