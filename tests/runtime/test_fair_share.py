"""Tenants share the colocated engine by weight in tokens served (the virtual token counter
of Sheng et al., OSDI '24): the scheduler charges prompt and output tokens, admits the least
served tenant's request first and preempts the most served; a tenant back from idle starts
at the busy tenants' counter; priorities still come first; one tenant keeps plain order."""

from __future__ import annotations

from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.scheduler import Scheduler, SchedulerConfig
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.core.tenant_tag import TenantTag
from bucketserve.runtime.core.virtual_token_counter import (
    OUTPUT_TOKEN_COST,
    PROMPT_TOKEN_COST,
    VirtualTokenCounter,
)
from tests.runtime.test_scheduler import run

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
HEAVY, LIGHT = TenantTag("heavy"), TenantTag("light", weight=2.0)


def make(num_blocks: int = 256, **config) -> Scheduler:
    config = {"watermark": 0.0, "scheduling_policy": "priority", **config}
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, 4), 1024)


def seq(name: str, tenant: TenantTag, n: int = 8, priority=(0, 0)) -> Sequence:
    return Sequence([10 + i for i in range(n)], LONG, seq_id=name, priority=priority, tenant=tenant)


def test_prompt_and_output_tokens_are_charged_by_weight() -> None:
    s = make()
    s.add(seq("h", HEAVY, 8))
    s.add(seq("l", LIGHT, 8))
    run(s)  # both prompts: 7 prompt tokens and the first output token each
    run(s)  # one decode token each
    for tenant in (HEAVY, LIGHT):
        cost = 7 * PROMPT_TOKEN_COST + 2 * OUTPUT_TOKEN_COST
        assert s.fair.counter(tenant.name) == cost / tenant.weight


def test_the_least_served_tenant_is_admitted_first_though_it_arrived_last() -> None:
    """Both tenants run one sequence and are served alike; light's weight 2 halves its
    counter, so when a slot frees its later arrival goes before heavy's earlier one."""
    s = make(max_num_seqs=2)
    s.add(seq("h0", HEAVY))
    s.add(seq("l0", LIGHT))
    s.add(seq("h1", HEAVY))
    s.add(seq("l1", LIGHT))
    for _ in range(5):
        run(s)
    assert s.fair.counter("heavy") == 2 * s.fair.counter("light") > 0
    s.abort("h0")
    assert [seq_id for seq_id, _ in run(s)] == ["l0", "l1"]


def test_a_newcomer_joins_at_the_busy_tenants_counter_not_below() -> None:
    """VTC's lift: light arrives while heavy alone is busy, so it starts level with heavy,
    not at 0 with a backlog of credit; level, the earlier arrival goes first."""
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(seq(f"h{i}", HEAVY))
    for _ in range(5):
        run(s)
    s.add(seq("l0", LIGHT))
    assert s.fair.counter("light") == s.fair.counter("heavy") > 0
    s.abort("h0")
    assert [seq_id for seq_id, _ in run(s)] == ["h1", "h2"]


def test_priorities_come_before_counters() -> None:
    s = make(max_num_seqs=1)
    s.add(seq("l0", LIGHT, priority=(1, 0)))
    run(s)
    s.add(seq("h0", HEAVY, priority=(0, 0)))  # heavy served nothing, light something
    s.add(seq("l1", LIGHT, priority=(1, 0)))
    s.abort("l0")
    assert [seq_id for seq_id, _ in run(s)] == ["h0"]
    s2 = make(max_num_seqs=1)
    s2.add(seq("h1", HEAVY, priority=(1, 0)))
    s2.add(seq("l2", LIGHT, priority=(0, 0)))
    s2.fair.charge(LIGHT, 10_000, 0)  # far more served, but of the better priority
    assert [seq_id for seq_id, _ in run(s2)] == ["l2"]


def test_the_counter_lifts_a_returning_tenant_to_the_least_served_busy_one() -> None:
    counter = VirtualTokenCounter()
    counter.charge(HEAVY, 100, 0)
    counter.charge(TenantTag("other"), 40, 0)
    counter.join("light", ["heavy", "other"])
    assert counter.counter("light") == 40.0  # the least served busy tenant's
    counter.charge(LIGHT, 1000, 0)
    counter.join("light", ["heavy"])  # never lowered
    assert counter.counter("light") == 40.0 + 500.0


def test_memory_pressure_preempts_the_most_served_tenant() -> None:
    """Both tenants' sequences run; the pool runs out: the victim is heavy's newest though
    light's sequence is newer overall."""
    s = make(num_blocks=9)  # 36 tokens: three 8-token prompts grow into it
    s.add(seq("h0", HEAVY))
    s.add(seq("h1", HEAVY))
    run(s)
    s.add(seq("l0", LIGHT))
    for _ in range(30):
        run(s)
        if s.num_preemptions:
            break
    assert s.num_preemptions >= 1
    assert s.get("h1").num_preemptions >= 1 and s.get("l0").num_preemptions == 0


def test_one_tenant_keeps_the_priority_order() -> None:
    s = make(max_num_seqs=1)
    s.add(seq("a", HEAVY, priority=(0, 5)))
    s.add(seq("b", HEAVY, priority=(0, 1)))
    assert [seq_id for seq_id, _ in run(s)] == ["b"]
