from bucketserve.bucket_manager import TenantConfig
from tests.bucket_manager.helpers import ids, make_manager, req

BIG = 10_000  # free blocks: memory never limits these tests
ARRIVALS = [("a", 700), ("b", 100), ("c", 150), ("d", 120), ("e", 800)]


def drain(manager, now: float = 10.0, free_blocks: int = BIG) -> list[list]:
    out = []
    while (batch := manager.next_batch(free_blocks, 16, now)) is not None:
        out.append(ids(batch))
    return out


def load(manager, tenant="default", **kw):
    for t, (rid, length) in enumerate(ARRIVALS):
        manager.add(req(rid, length, arrival=float(t), tenant=tenant, **kw))


def offline(policy: str, **kw) -> TenantConfig:
    return TenantConfig(name="default", tenant_class="offline", policy=policy, **kw)


def test_online_fcfs_serves_the_bucket_with_the_earliest_arrival():
    manager = make_manager(max_num_seqs=2)
    load(manager)
    # first call splits [0, 1024) at 512; the earliest request (a, 700) is in [512, 1024)
    assert drain(manager) == [["a", "e"], ["b", "c"], ["d"]]
    assert manager.snapshot().splits == 2 and manager.snapshot().merges == 1


def test_offline_sjf_and_ljf_inside_buckets():
    sjf = make_manager(offline("sjf"), max_num_seqs=2)
    load(sjf)
    assert drain(sjf) == [["b", "d"], ["c"], ["a", "e"]]
    ljf = make_manager(offline("ljf"), max_num_seqs=2)
    load(ljf)
    assert drain(ljf) == [["e", "a"], ["c", "d"], ["b"]]


def test_sjf_orders_by_expected_total_length_when_max_tokens_is_given():
    manager = make_manager(offline("sjf"))
    manager.add(req("long-output", 100, max_tokens=500))
    manager.add(req("short-output", 150, max_tokens=10))
    manager.add(req("prompt-only", 120))
    # three fit one batch; two fill a warmed batch size (1, 2, 4), the third goes next
    assert drain(manager) == [["prompt-only", "short-output"], ["long-output"]]


def test_request_priority_comes_before_arrival_and_length():
    fcfs = make_manager()
    fcfs.add(req("early", 100, arrival=0.0))
    fcfs.add(req("urgent", 100, arrival=5.0, priority=-1))
    assert drain(fcfs) == [["urgent", "early"]]
    sjf = make_manager(offline("sjf"))
    sjf.add(req("short", 100, priority=1))
    sjf.add(req("long", 300, priority=0))
    assert drain(sjf) == [["long", "short"]]


def test_tenant_priority_first_then_fair_share():
    manager = make_manager(
        TenantConfig(name="batch", priority=0),
        TenantConfig(name="vip", priority=-1),
        max_num_seqs=1,
    )
    for i in range(3):
        manager.add(req(f"b{i}", 10, arrival=0.0, tenant="batch"))
    for i in range(2):
        manager.add(req(f"v{i}", 900, arrival=1.0, tenant="vip"))
    assert drain(manager) == [["v0"], ["v1"], ["b0"], ["b1"], ["b2"]]


def test_fair_share_by_tokens_served_not_by_tokens_sent():
    # "heavy" sends 10x the tokens per request; with equal weights each gets the
    # same prefill tokens while both are backlogged: one heavy batch per ten light
    manager = make_manager(TenantConfig(name="heavy"), TenantConfig(name="light"), max_num_seqs=1)
    for i in range(30):
        manager.add(req(f"h{i}", 400, arrival=0.0, tenant="heavy"))
        manager.add(req(f"l{i}", 40, arrival=0.0, tenant="light"))
    served = [manager.next_batch(BIG, 16, 1.0).tenant for _ in range(22)]
    assert served == ["heavy"] + ["light"] * 10 + ["heavy"] + ["light"] * 10
    tokens = manager.snapshot().tokens_served_by_tenant
    assert tokens == {"heavy": 800, "light": 800}


def test_weights_scale_the_fair_share():
    manager = make_manager(
        TenantConfig(name="one"), TenantConfig(name="two", weight=2.0), max_num_seqs=1
    )
    for i in range(10):
        manager.add(req(f"o{i}", 100, tenant="one"))
        manager.add(req(f"t{i}", 100, tenant="two"))
    served = [manager.next_batch(BIG, 16, 1.0).tenant for _ in range(9)]
    assert served.count("two") == 6 and served.count("one") == 3


def test_a_tenant_back_from_idle_gets_no_backlog_of_credit():
    manager = make_manager(TenantConfig(name="busy"), TenantConfig(name="late"), max_num_seqs=1)
    for i in range(20):
        manager.add(req(f"b{i}", 100, tenant="busy"))
    for _ in range(10):
        manager.next_batch(BIG, 16, 1.0)  # busy has 1000 tokens served, late 0
    for i in range(10):
        manager.add(req(f"l{i}", 100, tenant="late"))
    served = [manager.next_batch(BIG, 16, 2.0).tenant for _ in range(6)]
    assert served == ["busy", "late", "busy", "late", "busy", "late"]


def test_aging_serves_a_long_request_under_a_steady_stream_of_short_ones():
    def run(max_wait_s):
        manager = make_manager(offline("sjf", max_wait_s=max_wait_s), max_num_seqs=2)
        manager.add(req("long", 900, arrival=0.0))
        served_at = None
        for step in range(40):  # two short requests arrive per second, two are served
            for j in range(2):
                manager.add(req(f"s{step}.{j}", 50, arrival=float(step)))
            batch = manager.next_batch(BIG, 16, float(step))
            if "long" in ids(batch):
                assert ids(batch)[0] == "long"
                served_at = step
        return served_at

    assert run(max_wait_s=None) is None  # pure SJF starves it
    assert run(max_wait_s=5.0) == 5  # served as soon as it has waited the bound


def test_aging_crosses_tenant_priorities_so_a_low_priority_tenant_never_starves():
    def run(max_wait_s):
        manager = make_manager(
            TenantConfig(name="vip", priority=-1),
            TenantConfig(name="batch", max_wait_s=max_wait_s),
            max_num_seqs=1,
        )
        manager.add(req("late", 100, arrival=0.0, tenant="batch"))
        served = []
        for step in range(10):  # the vip tenant always has a request queued
            manager.add(req(f"v{step}", 100, arrival=float(step), tenant="vip"))
            served.append(ids(manager.next_batch(BIG, 16, float(step)))[0])
        return served

    assert "late" not in run(max_wait_s=None)  # strict priority starves it
    assert run(max_wait_s=3.0) == ["v0", "v1", "v2", "late", "v3", "v4", "v5", "v6", "v7", "v8"]


def test_the_earliest_aged_arrival_goes_first_across_tenants():
    manager = make_manager(
        TenantConfig(name="a", max_wait_s=1.0), TenantConfig(name="b", priority=1, max_wait_s=1.0),
        max_num_seqs=1,
    )
    manager.add(req("a-young", 100, arrival=4.5, tenant="a"))
    manager.add(req("b-old", 100, arrival=1.0, tenant="b"))
    manager.add(req("a-old", 100, arrival=2.0, tenant="a"))
    # at 5.0 both old ones are past 1 s: b's arrived first; then a's by arrival, then the young
    assert drain(manager, now=5.0) == [["b-old"], ["a-old"], ["a-young"]]
