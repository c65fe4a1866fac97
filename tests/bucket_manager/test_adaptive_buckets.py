import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bucketserve.bucket_manager import AdaptiveBuckets, BucketRequest, Policy, RequestBucketConfig

_ids = itertools.count()


def push(buckets: AdaptiveBuckets, *lengths: int) -> None:
    for length in lengths:
        seq = next(_ids)
        request = BucketRequest(f"r{seq}", length)
        buckets.push(Policy.FCFS.order_key(request, seq), request)


def pop(buckets: AdaptiveBuckets, length: int) -> None:
    bucket = buckets.find(length)
    key = next(k for k, r in bucket.queues["default"] if r.prompt_len == length)
    bucket.pop("default", key)


def layout(buckets: AdaptiveBuckets) -> list[tuple[int, int, list[int]]]:
    return [
        (b.low, b.up, sorted(r.prompt_len for _, r in b.queues.get("default", [])))
        for b in buckets
    ]


def plain(max_len: int = 1024, **kw) -> AdaptiveBuckets:
    return AdaptiveBuckets(RequestBucketConfig(max_len=max_len, shape_edge_snap=0.0, **kw))


def test_algorithm_1_on_a_scripted_arrival_trace():
    buckets = plain()
    push(buckets, 100, 200, 700)
    assert buckets.adjust(n_max=4) == 0  # low load: one bucket
    assert layout(buckets) == [(0, 1024, [100, 200, 700])]

    push(buckets, 150, 300, 900)  # 6 > N_max and 4/6 below the midpoint 512
    assert buckets.adjust(n_max=4) == 1
    assert layout(buckets) == [(0, 512, [100, 150, 200, 300]), (512, 1024, [700, 900])]
    assert buckets.adjust(n_max=4) == 0  # 4 is not more than N_max

    push(buckets, 50, 120)  # load persists: [0, 512) now holds 6, 5 of them below 256
    assert buckets.adjust(n_max=4) == 1
    assert layout(buckets) == [
        (0, 256, [50, 100, 120, 150, 200]),
        (256, 512, [300]),
        (512, 1024, [700, 900]),
    ]
    push(buckets, 20, 600)  # new arrivals land by bisection in the current buckets
    assert [len(b) for b in buckets] == [6, 1, 3]

    push(buckets, 800, 850, 950, 1000)  # 7 in [512, 1024) but only 2/7 below 768: no split
    assert buckets.adjust(n_max=4) == 1  # only [0, 256) splits (6 > 4, 5/6 below 128)
    assert buckets.boundaries == [0, 128, 256, 512, 1024]
    assert buckets.splits == 3 and buckets.merges == 0

    for length in (20, 50, 100, 120, 150, 200, 300, 600, 700, 800, 850, 950):
        pop(buckets, length)
    assert buckets.adjust(n_max=4) == -1  # total 2 < N_max: everything merges
    assert layout(buckets) == [(0, 1024, [900, 1000])]
    assert buckets.merges == 1
    assert buckets.adjust(n_max=4) == 0 and buckets.merges == 1


def test_merge_keeps_every_tenant_queue_in_order():
    buckets = plain()
    push(buckets, 10, 600, 20, 700, 30)
    buckets.adjust(n_max=2)
    assert buckets.boundaries == [0, 512, 1024]
    pop(buckets, 20)
    buckets.adjust(n_max=5)
    assert [r.prompt_len for _, r in buckets.buckets[0].queues["default"]] == [10, 600, 700, 30]


def test_one_split_per_bucket_per_call():
    buckets = plain()
    push(buckets, *[5] * 10)
    for expected in ([0, 512, 1024], [0, 256, 512, 1024], [0, 128, 256, 512, 1024]):
        assert buckets.adjust(n_max=2) == 1
        assert buckets.boundaries == expected


def test_max_buckets_caps_splitting_and_narrow_buckets_stop_splitting():
    buckets = plain(max_buckets=3)
    push(buckets, *[1] * 10)
    for _ in range(5):
        buckets.adjust(n_max=2)
    assert buckets.boundaries == [0, 256, 512, 1024]
    tiny = plain(max_len=4)
    push(tiny, 1, 1, 1, 3)
    assert tiny.adjust(n_max=1) == 1
    assert tiny.boundaries == [0, 2, 4]
    assert tiny.adjust(n_max=1) == 0  # [0, 2) holds 3, none below its midpoint 1


def test_split_snaps_to_a_nearby_shape_edge():
    edges = [128, 256, 384, 640, 1024]
    snapping = AdaptiveBuckets(RequestBucketConfig(max_len=1024, shape_edge_snap=0.25), edges)
    push(snapping, 100, 200, 300, 400, 900)
    snapping.adjust(n_max=2)
    assert snapping.boundaries == [0, 640, 1024]  # 384 and 640 tie; the higher edge wins
    assert layout(snapping)[0] == (0, 640, [100, 200, 300, 400])

    far = AdaptiveBuckets(RequestBucketConfig(max_len=1024, shape_edge_snap=0.25), [100, 1000])
    push(far, 100, 200, 300, 400, 900)
    far.adjust(n_max=2)
    assert far.boundaries == [0, 512, 1024]  # the nearest edge is 412 tokens away

    off = AdaptiveBuckets(RequestBucketConfig(max_len=1024, shape_edge_snap=0.0), edges)
    push(off, 100, 200, 300, 400, 900)
    off.adjust(n_max=2)
    assert off.boundaries == [0, 512, 1024]


@given(
    bounds=st.lists(st.integers(1, 4095), max_size=63, unique=True),
    lengths=st.lists(st.integers(0, 4095), min_size=1, max_size=50),
)
def test_lookup_finds_the_bucket_holding_each_length(bounds, lengths):
    buckets = plain(max_len=4096, max_buckets=64)
    edges = sorted(bounds)
    for low, up in zip([0, *edges], [*edges, 4096], strict=True):
        buckets.buckets.append(type(buckets.buckets[0])(low, up))
    buckets.buckets = buckets.buckets[1:]
    buckets._uppers = [b.up for b in buckets.buckets]
    for length in lengths:
        found = buckets.find(length)
        assert found is next(b for b in buckets.buckets if b.low <= length < b.up)


def test_lengths_outside_the_buckets_are_rejected():
    buckets = plain()
    with pytest.raises(ValueError, match=r"prompt length 1024 is outside the request buckets"):
        buckets.find(1024)
    with pytest.raises(ValueError, match=r"RequestBucketConfig\.max_len"):
        buckets.find(5000)
    assert len(buckets) == 0


def test_expected_waste_is_eq3_over_the_queued_lengths():
    buckets = plain()
    push(buckets, 100, 200, 700, 150, 300, 900)
    assert buckets.expected_waste() == pytest.approx(
        sum(1 - s / 1024 for s in (100, 200, 700, 150, 300, 900)) / 6
    )
    buckets.adjust(n_max=4)
    expected = sum(1 - s / 512 for s in (100, 150, 200, 300)) + (1 - 700 / 1024) + (1 - 900 / 1024)
    assert buckets.expected_waste() == pytest.approx(expected / 6)
