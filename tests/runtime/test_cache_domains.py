"""Prefix-cache domains and shares: no hit crosses tenants (a shared domain shares, a salt
narrows, a forced hash collision still misses), eviction takes from the tenant most over
its share (Hypothesis interleavings), per-tenant counts, and the offline engine's output
unchanged whoever's cache it reads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bucketserve.runtime.core import block_hash
from bucketserve.runtime.core.block_hash import ROOT_HASH, domain_root
from bucketserve.runtime.core.block_manager import BlockManager
from bucketserve.runtime.core.sampling_params import SamplingParams
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.core.tenant_tag import TenantTag

BS = 4
PROMPT = list(range(100, 126))  # 6 full blocks and 2 tokens
A, B = TenantTag("a", cache_domain="a"), TenantTag("b", cache_domain="b")


def run(bm: BlockManager, tokens: list[int], tenant: TenantTag) -> Sequence:
    """A sequence of `tenant` allocated, computed to its end, freed (its blocks cached)."""
    seq = Sequence(tokens, tenant=tenant)
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.cache_computed(seq)
    bm.free(seq)
    return seq


def test_a_tenant_hits_its_own_prefix_and_never_another_tenants() -> None:
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    assert run(bm, PROMPT, A).num_cached_tokens == 0
    assert run(bm, PROMPT, B).num_cached_tokens == 0  # the same tokens, another domain
    assert run(bm, PROMPT, A).num_cached_tokens == 24
    assert run(bm, PROMPT, B).num_cached_tokens == 24  # its own copy, cached by its first run
    stats = bm.tenant_stats()
    assert (stats["a"].queries, stats["a"].hits) == (52, 24)
    assert (stats["b"].queries, stats["b"].hits) == (52, 24)
    assert stats["a"].cached_blocks == stats["b"].cached_blocks == 6


def test_tenants_naming_one_domain_share_and_a_salt_narrows_it() -> None:
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    team_a, team_c = TenantTag("a", cache_domain="team"), TenantTag("c", cache_domain="team")
    run(bm, PROMPT, team_a)
    assert run(bm, PROMPT, team_c).num_cached_tokens == 24
    salted = TenantTag("c", cache_domain="team", cache_salt="s1")
    assert run(bm, PROMPT, salted).num_cached_tokens == 0
    assert run(bm, PROMPT, salted).num_cached_tokens == 24
    other_salt = TenantTag("c", cache_domain="team", cache_salt="s2")
    assert run(bm, PROMPT, other_salt).num_cached_tokens == 0
    assert bm.tenant_stats()["a"].cached_blocks == 6  # c's hits take no ownership


def test_roots_are_digests_every_process_agrees_on() -> None:
    assert domain_root() == ROOT_HASH
    assert domain_root("a") == domain_root("a") != domain_root("b")
    assert domain_root("a", "s") not in (domain_root("a"), domain_root("a", "t"))
    assert domain_root("a", None) != domain_root(None, "a")
    code = "from bucketserve.runtime.core.block_hash import domain_root as r; print(r('t', 's'))"
    for seed in ("1", "2"):  # str hashes differ between these processes; roots must not
        out = subprocess.run(
            [sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert int(out.stdout) == domain_root("t", "s")


def test_a_hash_collision_across_domains_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block hashes alike: only the root (and the tokens) stored with a block tell a
    hit, so another domain's identical prefix is never handed out."""
    monkeypatch.setattr(block_hash, "hash_block", lambda parent, tokens: 7)
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    run(bm, PROMPT, A)  # caches its first block; each later one collides with it: not cached
    assert run(bm, PROMPT, B).num_cached_tokens == 0
    assert bm.num_cached_tokens(Sequence(PROMPT, tenant=A)) == 4
    for tenant, hits in ((B, 0), (A, 1)):
        reserved, found = bm.reserve_prefix(PROMPT, 7, root=tenant.cache_root)
        assert found == hits
        bm.release(reserved)


def test_a_decode_reservation_takes_cached_blocks_of_its_own_domain_only() -> None:
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    run(bm, PROMPT, A)
    blocks, hits = bm.reserve_prefix(PROMPT, 7, root=B.cache_root)
    assert hits == 0
    bm.release(blocks)
    blocks, hits = bm.reserve_prefix(PROMPT, 7, root=A.cache_root)
    assert hits == 6
    bm.release(blocks)


def fill(bm: BlockManager, tenant: TenantTag, start: int, blocks: int) -> None:
    """`blocks` full blocks of fresh tokens for `tenant`, cached and free."""
    run(bm, list(range(start, start + blocks * BS + 1)), tenant)


def test_eviction_takes_from_the_tenant_over_its_share_first() -> None:
    """Chat's 4-block system prompt is the least recently freed; noisy holds 10 of the 14
    evictable blocks, past its quarter share: taking 9 blocks (the 2 uncached ones free,
    7 cached), the LRU evicts chat's prompt, while with shares noisy's own blocks go (it
    stays over its share until then)."""
    chat, noisy = TenantTag("chat", cache_domain="chat"), TenantTag("noisy", cache_domain="n")
    system = list(range(1, 4 * BS + 1))
    for shares, chat_keeps, evicted in ((None, 0, (4, 3)), ({"noisy": 0.25}, 16, (0, 8))):
        bm = BlockManager(16, BS, enable_prefix_caching=True, cache_shares=shares)
        run(bm, [*system, 999], chat)
        fill(bm, noisy, 10_000, 10)
        fill(bm, noisy, 20_000, 8)  # 9 blocks
        assert bm.num_cached_tokens(Sequence([*system, 5], tenant=chat)) == chat_keeps
        stats = bm.tenant_stats()
        assert (stats["chat"].evictions, stats["noisy"].evictions) == evicted


class ShareMachine(RuleBasedStateMachine):
    """Random tenants, prompts (shared prefixes among them), frees and shares: whenever a
    cached block is evicted while a tenant is over its share, it is that of the tenant
    most over it, the LRU one of its blocks; every count stays exact."""

    def __init__(self) -> None:
        super().__init__()
        self.shares = {"t0": 0.25, "t1": 0.5}  # t2 has no bound
        self.bm = BlockManager(12, BS, enable_prefix_caching=True, cache_shares=self.shares)
        self.live: list[Sequence] = []
        self.checked = 0
        victim = self.bm._victim

        def checked_victim() -> int:
            bm = self.bm
            head = next(iter(bm._free))
            expected = head
            if head in bm._meta:
                total = bm._num_evictable
                over = {
                    t: len(blocks) - self.shares.get(t, 1.0) * total
                    for t, blocks in bm._evictable.items()
                }
                worst = max(over, key=over.get, default=None)
                if worst is not None and over[worst] > 0:
                    expected = next(iter(bm._evictable[worst]))
                    self.checked += 1
            got = victim()
            assert got == expected
            return got

        self.bm._victim = checked_victim

    @rule(
        tenant=st.sampled_from(["t0", "t1", "t2"]),
        prefix=st.integers(0, 2),
        length=st.integers(1, 14),
        salt=st.sampled_from([None, None, "s"]),
    )
    def start(self, tenant: str, prefix: int, length: int, salt: str | None) -> None:
        tokens = [prefix * 1000 + i for i in range(length)]
        seq = Sequence(tokens, tenant=TenantTag(tenant, cache_domain="d", cache_salt=salt))
        if not self.bm.can_allocate(seq):
            return
        self.bm.allocate(seq)
        seq.num_computed_tokens = len(seq)
        self.bm.cache_computed(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 20))
    def finish(self, index: int) -> None:
        self.bm.free(self.live.pop(index % len(self.live)))

    @invariant()
    def counts_are_exact(self) -> None:
        bm = self.bm
        owners = Counter(meta[4] for meta in bm._meta.values())
        assert +bm.cached_blocks_by_tenant == owners
        free_cached = Counter(bm._meta[b][4] for b in bm._free if b in bm._meta)
        assert {t: len(blocks) for t, blocks in bm._evictable.items()} == dict(free_cached)
        assert bm._num_evictable == sum(free_cached.values())
        held = Counter(b for s in self.live for b in s.block_table)
        assert all(bm.ref_count(b) == n for b, n in held.items())
        assert bm.num_free_blocks == bm.num_total_blocks - len(held)

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_total_blocks


TestShareMachine = ShareMachine.TestCase
TestShareMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_share_machine_meets_tenants_over_their_share() -> None:
    """The interleavings above are not vacuous: a scripted run checks an over-share pick."""
    machine = ShareMachine()
    for i in range(6):
        machine.start("t0", i, 13, None)
        machine.finish(0)
    machine.start("t1", 9, 13, None)
    assert machine.checked > 0
    machine.teardown()


def test_offline_engine_tokens_do_not_depend_on_whose_cache_they_read(
    tiny_model_dir: Path,
) -> None:
    """Two tenants and a salt over one engine: greedy tokens equal the uncached engine's;
    `num_cached_tokens` reports only hits of the request's own domain."""
    from bucketserve.runtime.engine.engine_config import EngineConfig
    from bucketserve.runtime.engine.llm_engine import LLMEngine
    from bucketserve.runtime.worker.runner_config import ModelRunnerConfig

    prompt = [5 + i for i in range(40)]
    params = SamplingParams(temperature=0, max_tokens=6)
    runner = ModelRunnerConfig(model=str(tiny_model_dir), block_size=BS, num_kv_blocks=64)
    engine = LLMEngine(EngineConfig(runner=runner))
    reference = LLMEngine(
        EngineConfig(runner=runner.model_copy(update={"enable_prefix_caching": False}))
    )

    def generate(eng: LLMEngine, tenant: TenantTag | None = None) -> tuple[list[int], int]:
        rid = eng.add_request(prompt, params, **({"tenant": tenant} if tenant else {}))
        while True:
            for out in eng.step():
                if out.request_id == rid and out.finished:
                    return out.token_ids, out.num_cached_tokens

    want, _ = generate(reference)
    a, b = TenantTag("a", cache_domain="a"), TenantTag("b", cache_domain="b")
    salted = TenantTag("a", cache_domain="a", cache_salt="salt")
    seen = [generate(engine, t) for t in (a, b, a, salted)]
    assert [tokens for tokens, _ in seen] == [want] * 4
    assert [cached for _, cached in seen] == [0, 0, 36, 0]
