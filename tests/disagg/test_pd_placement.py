"""Cache-aware placement: the controller's prefix index, the PDScheduler's choice (a shared
prefix goes where it is cached unless that worker lacks room; without one, the least-loaded
choice), and the Dispatcher queuing and placing requests by it. No worker runs here."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

from bucketserve.bucket_manager import BucketRequest, PrefillBatch, TenantConfig
from bucketserve.controller.controller import Controller
from bucketserve.controller.pd_scheduler import PDScheduler
from bucketserve.controller.prefix_index import PrefixIndex
from bucketserve.runtime.core.block_hash import block_hashes
from bucketserve.runtime.core.sampling_params import SamplingParams
from tests.disagg.helpers import (
    IdleHandle,
    assert_drained,
    controller_config,
    dispatch,
    generate,
    queue,
    reference_outputs,
    tokens,
)

BS = 4
PREFIX = list(range(100, 140))  # 10 full blocks of 4


def hashes(tokens: list[int]) -> tuple[int, ...]:
    return tuple(block_hashes(tokens, BS))


def request(rid: str, tokens: list[int], max_tokens: int = 4) -> BucketRequest:
    return BucketRequest(rid, len(tokens), max_tokens, block_hashes=hashes(tokens))


def batch(*requests: BucketRequest) -> PrefillBatch:
    n = len(requests)
    blocks = tuple(-(-(r.prompt_len + r.max_tokens) // BS) for r in requests)
    return PrefillBatch(
        0, "default", requests, (0, 1024), (n, 64, 0), False, blocks, BS, 0.0, 0.0, 0.0, 0,
        order_keys=((0.0,),) * n,
    )  # fmt: skip


# -- the index ---------------------------------------------------------------------------


def test_matched_tokens_count_leading_blocks_only():
    index = PrefixIndex(BS)
    index.insert("w0", hashes([*PREFIX, 1, 2, 3, 4]))
    assert index.matched_tokens("w0", hashes([*PREFIX, 9, 9, 9, 9])) == 40
    assert index.matched_tokens("w0", hashes([7] * 4 + PREFIX)) == 0  # no leading block
    assert index.matched_tokens("w1", hashes(PREFIX)) == 0
    assert index.holders(hashes(PREFIX)[0]) == {"w0"}
    assert index.best_match(hashes(PREFIX)) == 10


def test_the_lru_is_bounded_by_the_workers_blocks_and_ages_a_prefix_from_its_tail():
    index = PrefixIndex(BS)
    index.set_capacity("w0", 12)
    a, b = hashes(PREFIX), hashes([5] * 16)  # 10 and 4 blocks
    index.insert("w0", a)
    index.insert("w0", b)
    assert index.num_blocks("w0") == 12
    assert index.matched_blocks("w0", a) == 8  # its last two blocks went first
    assert index.matched_blocks("w0", b) == 4
    index.insert("w0", a)  # sent again: most recent, b's tail goes
    assert index.matched_blocks("w0", a) == 10 and index.matched_blocks("w0", b) == 2
    index.set_capacity("w0", 3)
    assert index.num_blocks("w0") == 3 and index.matched_blocks("w0", a) == 3


def test_a_dead_or_reset_worker_holds_nothing():
    index = PrefixIndex(BS)
    for w in ("w0", "w1"):
        index.insert(w, hashes(PREFIX))
    index.clear("w0")
    assert index.holders(hashes(PREFIX)[0]) == {"w1"} and index.num_blocks("w0") == 0
    index.reset()
    assert len(index) == 0 and index.holders(hashes(PREFIX)[0]) == set()


# -- the PDScheduler -----------------------------------------------------------------------


def scheduler(rooms: list[int], cache_aware: bool = True) -> PDScheduler:
    pd = PDScheduler(len(rooms), BS, cache_aware=cache_aware)
    for i, room in enumerate(rooms):
        pd.update(i, room, load=0)
    return pd


def test_a_shared_prefix_lands_on_the_decode_worker_holding_it():
    pd = scheduler([100, 100, 100])
    first = batch(request("a", [*PREFIX, 1, 2]))
    assert pd.place_decode(first, min_room=10) == 0  # nothing cached: the least loaded
    pd.dispatched(first, decode=2)
    again = batch(request("b", [*PREFIX, 3, 4, 5]))
    assert pd.place_decode(again, min_room=10) == 2
    pd.update(2, 95, load=3)  # 5 blocks less room than the roomiest, 10 cached: still there
    assert pd.place_decode(again, min_room=10) == 2
    pd.update(2, 85, load=3)  # 15 blocks less: the cache no longer pays for it
    assert pd.place_decode(again, min_room=10) == 0
    pd.update(2, 95, load=3)
    assert pd.place_decode(again, min_room=96) == 0  # too little room for the batch
    assert scheduler([100, 100, 100], cache_aware=False).place_decode(again, 10) == 0


def test_without_shared_prefixes_placement_is_the_least_loaded_choice():
    pd = scheduler([50, 80, 80])
    pd.update(2, 80, load=1)
    for i in range(5):
        b = batch(request(f"r{i}", [i + 1] * 30))
        assert pd.place_decode(b, min_room=1) == pd.pick_decode() == 1
        pd.dispatched(b, decode=1)


def test_a_dead_decode_worker_loses_its_cache():
    pd = scheduler([100, 100])
    b = batch(request("a", [*PREFIX, 1]))
    pd.dispatched(b, decode=1)
    pd.remove(1)
    assert pd.place_decode(b, 1) == 0
    pd.update(1, 100, load=0)  # back, empty
    assert pd.place_decode(b, 1) == 0 and pd.decode_cache.num_blocks(1) == 0


def test_the_batch_scores_each_request_on_its_own():
    pd = scheduler([100, 100])
    pd.dispatched(batch(request("x", [*PREFIX, 1])), decode=1)
    pd.dispatched(batch(request("y", [7] * 40 + [1])), decode=0)
    mixed = batch(request("a", [*PREFIX, 2]), request("b", [*PREFIX, 3]), request("c", [7] * 41))
    assert pd.cached_blocks(pd.decode_cache, 1, mixed) == 20
    assert pd.cached_blocks(pd.decode_cache, 0, mixed) == 10
    assert pd.place_decode(mixed, 1) == 1
    assert pd.uncached_blocks(pd.decode_cache, 1, mixed) == 11 + 11 + 11 - 20


def test_the_last_token_is_never_counted_as_cached():
    pd = scheduler([100, 100])
    pd.dispatched(batch(request("x", PREFIX)), decode=1)
    assert pd.expected_cached(pd.decode_cache, hashes(PREFIX), len(PREFIX)) == 36
    assert pd.expected_cached(pd.decode_cache, hashes(PREFIX), len(PREFIX) + 1) == 40
    assert pd.expected_cached(pd.prefill_cache, hashes(PREFIX), len(PREFIX) + 1) == 0


def test_a_request_ending_at_prefill_is_not_cached_on_the_decode_side():
    pd = scheduler([100, 100])
    b = batch(request("one", [*PREFIX, 1], max_tokens=1), request("on", [3] * 9, max_tokens=4))
    pd.dispatched(b, decode=0, prefill="p1")
    assert pd.decode_cache.holders(hashes(PREFIX)[0]) == set()
    assert pd.decode_cache.num_blocks(0) == 2
    assert pd.prefill_cache.num_blocks("p1") == 12
    pd.reset_prefix_cache()
    assert len(pd.prefill_cache) == len(pd.decode_cache) == 0


def test_prefill_placement_weighs_cached_blocks_against_the_work_queued_there():
    pd = scheduler([100])
    b = batch(request("a", [*PREFIX, 1]))
    names, limit = ["p0", "p1"], 2
    assert pd.place_prefill(b, names, [200, 200], [0, 0], limit) == 0
    pd.dispatched(b, prefill="p1")
    assert pd.place_prefill(b, names, [200, 200], [0, 1], limit) == 1  # 10 cached, 0 queued
    pd.prefill_sent("p1", 8)
    assert pd.place_prefill(b, names, [200, 200], [0, 1], limit) == 1  # 10 - 8 > 0
    pd.prefill_sent("p1", 4)
    assert pd.place_prefill(b, names, [200, 200], [0, 1], limit) == 0  # 10 - 12 < 0
    pd.prefill_done("p1", 12)
    assert pd.prefill_queued == {}
    assert pd.place_prefill(b, names, [200, 200], [0, 2], limit) == 0  # no free slot
    assert pd.place_prefill(b, names, [200, 10], [0, 0], limit) == 0  # no room for it
    assert pd.place_prefill(b, names, [200, 200], [2, 2], limit) is None


def test_load_weight_is_checked():
    with pytest.raises(ValueError, match="load_weight must be a number >= 0"):
        PDScheduler(1, BS, load_weight=-1.0)


# -- the Dispatcher --------------------------------------------------------------------------


def test_the_colocated_dispatcher_queues_by_cached_length_and_places_by_cache(
    tiny_model_dir: Path,
) -> None:
    config = controller_config(
        tiny_model_dir, mode="local", topology="colocated", decode={"num_workers": 2}
    )
    c = Controller(config)
    d0, d1 = IdleHandle("decode-0", 256), IdleHandle("decode-1", 256)
    c.pool.handles = [d0, d1]
    first = queue(c, "first", [*PREFIX, 1, 2, 3])
    dispatch(c)
    assert first.decode_worker == "decode-0"  # equal rooms: the lowest number
    d0.stats.num_free_blocks = 250  # 6 blocks less room, 10 cached there
    again = queue(c, "again", [*PREFIX, 4, 5])
    assert c.buckets._entries["again"].request.cached_len == 40
    dispatch(c)
    assert again.decode_worker == "decode-0"
    other = queue(c, "other", [9] * 45)
    assert c.buckets._entries["other"].request.cached_len == 0
    dispatch(c)
    assert other.decode_worker == "decode-1"  # nothing shared: the most room
    d0.mark_dead()
    d0.alive = True  # a new life, its cache empty
    after = queue(c, "after", [*PREFIX, 6])
    assert c.buckets._entries["after"].request.cached_len == 0
    dispatch(c)
    assert after.decode_worker == "decode-1"
    c.dispatcher.reset_prefix_cache()
    assert len(c.dispatcher.pd.decode_cache) == 0


def test_without_prefix_caching_nothing_is_hashed_or_moved(tiny_model_dir: Path) -> None:
    config = controller_config(
        tiny_model_dir, mode="local", topology="colocated", decode={"num_workers": 2}
    )
    runner = config.runner.model_copy(update={"enable_prefix_caching": False})
    config = config.model_copy(update={"runner": runner})
    c = Controller(config)
    d0, d1 = IdleHandle("decode-0", 256), IdleHandle("decode-1", 250)
    c.pool.handles = [d0, d1]
    for rid, worker in (("a", "decode-0"), ("b", "decode-1")):
        state = queue(c, rid, [*PREFIX, 1])
        assert c.buckets._entries[rid].request.block_hashes == ()
        dispatch(c)
        assert state.decode_worker == worker  # the most room, whatever b shares with a
        d0.stats.num_free_blocks = 249
    assert len(c.dispatcher.pd.decode_cache) == 0


def test_served_requests_sharing_a_prefix_follow_it_and_match_the_engine(
    tiny_model_dir: Path,
) -> None:
    """Two local decode workers: requests with the prefix of the first one go where it went,
    though the other worker has more room now, and every output is the in-process
    engine's."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 49152) for _ in range(48)]  # 12 blocks
    params = SamplingParams(temperature=0, max_tokens=6)
    work = [([*prefix, *(rng.randrange(3, 49152) for _ in range(5))], params) for _ in range(3)]
    work.append(([rng.randrange(3, 49152) for _ in range(30)], params))
    reference = reference_outputs(tiny_model_dir, work)

    async def main() -> tuple[list, Any, set]:
        config = controller_config(
        tiny_model_dir, mode="local", topology="colocated", decode={"num_workers": 2}
    )
        controller = Controller(config)
        await controller.start()
        outputs = []
        try:
            for i, item in enumerate(work):  # one after another: each placed after the last
                outputs += tokens(await generate(controller, [item], f"r{i}"))
                await controller.drain(30)
                # decode-0 (where the first went: equal rooms) books 5 blocks elsewhere
                controller.pool.role("decode")[0].pending_blocks = 5
            stats = await controller.drain(30)
            root = TenantConfig(name="default").tag().cache_root  # a service without tenants
            first = block_hashes(prefix, BS, root=root)[0]
            holders = controller.dispatcher.pd.decode_cache.holders(first)
        finally:
            await controller.shutdown()
        return outputs, stats, holders

    outputs, stats, holders = asyncio.run(main())
    assert outputs == reference
    assert holders == {0}  # 12 cached blocks outweigh 5 blocks less room
    assert_drained(stats)
