"""Paged KV block allocation, per-sequence block tables and the prefix cache (torch-free)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

from bucketserve.runtime.core.block_hash import ROOT_HASH, BlockHash, block_hashes
from bucketserve.runtime.core.sequence import Sequence


@dataclass(frozen=True)
class TenantCacheStats:
    """One tenant's prefix-cache figures in one pool (`BlockManager.tenant_stats`)."""

    cached_blocks: int = 0
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, found cached
    evictions: int = 0  # cached blocks it named, evicted to make room


class BlockManager:
    """Hands out fixed-size KV blocks and keeps `seq.block_table`.

    Every block has a reference count, and a block is free exactly when its count is 0, so
    blocks shared between tables (a forked prefix, a cached prefix) are freed by their last
    holder. Blocks can also be reserved with no sequence yet — the landing place of an
    incoming KV transfer — and later attached to the sequence that arrives prefilled.

    With `enable_prefix_caching`, a full block whose K/V is computed is named by its hash
    (`block_hash`) and stays cached after it is freed: free blocks form an LRU, evicted from
    the least recently freed end only when a block must be taken. A new sequence (or one
    resuming after preemption) starts with every leading block already cached, its last
    token always left to compute so the step samples. A hit is checked against the block's
    tokens, its parent block and its chain's root (the sequence's cache domain,
    `TenantTag.cache_root`), so a hash collision costs a miss, never wrong K/V, and no
    sequence hits a block named in another domain.

    Every cached block belongs to the tenant whose sequence named it. `cache_shares` (tenant
    -> fraction) bounds a tenant's hold on the evictable blocks (cached, free) while others
    want room: when the block the LRU would evict is a cached one, the LRU block of the
    tenant most over its share (holding more than its fraction of all evictable blocks) goes
    instead; tenants without a share are never over it. Per tenant it counts blocks held,
    prompt tokens looked up and found cached, and cached blocks evicted.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        cache_shares: Mapping[str, float] | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._reserved: Counter[int] = Counter()
        # the prefix cache: hash -> block, and per cached block its
        # (hash, parent block, tokens, root, owning tenant)
        self._cached: dict[BlockHash, int] = {}
        self._meta: dict[int, tuple[BlockHash, int, tuple[int, ...], BlockHash, str]] = {}
        self._pending: set[int] = set()  # named for a step not run yet: no K/V to read
        self._shares = dict(cache_shares or {})
        self._evictable: dict[str, OrderedDict[int, None]] = {}  # tenant -> its free cached
        self._num_evictable = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up, as vLLM counts them
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.cached_blocks_by_tenant: Counter[str] = Counter()
        self.queries_by_tenant: Counter[str] = Counter()
        self.hits_by_tenant: Counter[str] = Counter()
        self.evictions_by_tenant: Counter[str] = Counter()

    @property
    def num_total_blocks(self) -> int:
        return len(self._ref_counts)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones among them (they are evicted when taken)."""
        return len(self._free)

    @property
    def num_reserved_blocks(self) -> int:
        return len(self._reserved)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def tenant_stats(self) -> dict[str, TenantCacheStats]:
        """Per tenant: cached blocks it named that are still cached, prompt tokens looked
        up and found cached, cached blocks evicted."""
        counters = (
            self.cached_blocks_by_tenant,
            self.queries_by_tenant,
            self.hits_by_tenant,
            self.evictions_by_tenant,
        )
        tenants = sorted({t for counts in counters for t in counts})
        return {t: TenantCacheStats(*(counts[t] for counts in counters)) for t in tenants}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- sequences ---------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_blocks_to_allocate(seq) <= len(self._free)

    def num_blocks_to_allocate(self, seq: Sequence) -> int:
        """Free blocks `allocate(seq)` takes: its blocks less the cached ones others hold."""
        held = sum(1 for b in self._hits(seq) if self._ref_counts[b] > 0)
        return self.blocks_needed(len(seq)) - held

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Leading tokens of `seq` `allocate` would find cached (no effect)."""
        return len(self._hits(seq)) * self.block_size

    def allocate(self, seq: Sequence) -> None:
        """A table covering every token of `seq`: its cached leading blocks (which then count
        as computed) and fresh ones for the rest."""
        if seq.block_table:
            raise ValueError(f"seq {seq.seq_id} already holds {len(seq.block_table)} blocks")
        starts = seq.num_computed_tokens == 0  # new, or resuming after preemption
        hits = self._hits(seq) if starts else []
        fresh = self.blocks_needed(len(seq)) - len(hits)
        shortfall = fresh - len(self._free) + sum(1 for b in hits if self._ref_counts[b] == 0)
        if shortfall > 0:
            raise ValueError(
                f"seq {seq.seq_id} needs {fresh} more blocks, {len(self._free)} are free"
            )
        for block in hits:
            self._hold(block)
        seq.block_table = hits + self._take(fresh)
        if self.enable_prefix_caching and starts:
            cached = len(hits) * self.block_size
            seq.num_computed_tokens = cached
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = cached
                hit = min(cached, seq.num_prompt_tokens)
                self.prefix_cache_queries += seq.num_prompt_tokens
                self.prefix_cache_hits += hit
                self.queries_by_tenant[seq.tenant.name] += seq.num_prompt_tokens
                self.hits_by_tenant[seq.tenant.name] += hit

    def can_append(self, seq: Sequence) -> bool:
        return self._shortfall(seq) <= len(self._free)

    def append_slot(self, seq: Sequence) -> None:
        """Grow the table so it covers every token of `seq`, including the one just appended."""
        self._grow(seq, self._shortfall(seq))

    def cache_computed(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Name the full blocks of `seq`'s first `num_tokens` tokens (default: those computed),
        so later sequences with the same prefix reuse them. The scheduler names them when it
        schedules their step; until that step has run they are pending, and a sequence whose
        prefix reaches one waits for it (`waits_for`) rather than compute it again."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_tokens = seq.num_computed_tokens if num_tokens is None else num_tokens
        full = min(num_tokens // bs, len(seq.block_table))
        done = seq.num_computed_tokens // bs
        for block in seq.block_table[:min(done, full)]:
            self._pending.discard(block)
        self._pending.update(seq.block_table[done:full])
        root, owner = seq.tenant.cache_root, seq.tenant.name
        hashes = block_hashes(seq.token_ids, bs, seq.block_hashes, full, root)
        parent = -1  # the cached block holding the prefix so far, verified
        for i in range(full):
            block = seq.block_table[i]
            if block in self._meta:
                parent = block
                continue
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            other = self._cached.get(hashes[i])
            if other is None:
                self._meta[block] = (hashes[i], parent, tokens, root, owner)
                self._cached[hashes[i]] = block
                self.cached_blocks_by_tenant[owner] += 1
                parent = block
            elif self._meta[other][1:4] == (parent, tokens, root):
                parent = other  # the same prefix, cached in another block
            else:
                return  # a hash collision: what follows would claim another prefix

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; blocks nobody else holds become free (cached ones stay
        cached until evicted)."""
        if not seq.block_table:
            raise ValueError(f"seq {seq.seq_id} holds no blocks (freed twice?)")
        self._check_live(seq.block_table, f"seq {seq.seq_id}")
        # the tail first: the LRU then evicts a prefix's last blocks before its first ones
        self._decref(seq.block_table[::-1] if self.enable_prefix_caching else seq.block_table)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Share the parent's full blocks holding its first `num_tokens` tokens with `child`,
        whose table must be empty and whose tokens must start with those same tokens."""
        num_blocks = num_tokens // self.block_size
        if child.block_table:
            raise ValueError(f"seq {child.seq_id} already holds blocks; fork needs an empty table")
        if not 0 <= num_tokens <= min(parent.num_computed_tokens, len(child)):
            raise ValueError(
                f"can share at most {min(parent.num_computed_tokens, len(child))} tokens, "
                f"got {num_tokens}"
            )
        if parent.token_ids[:num_tokens] != child.token_ids[:num_tokens]:
            raise ValueError("child's tokens do not start with the shared prefix")
        shared = parent.block_table[:num_blocks]
        for block in shared:
            self._ref_counts[block] += 1
        child.block_table = list(shared)

    # -- reservations (incoming KV transfers) ------------------------------------------------

    def can_reserve(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def reserve(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks for a transfer that has no sequence yet."""
        return self.reserve_prefix((), num_blocks)[0]

    def reserve_prefix(
        self, token_ids: Tokens[int], num_blocks: int, root: BlockHash = ROOT_HASH
    ) -> tuple[list[int], int]:
        """Reserve `num_blocks` blocks for a transfer of `token_ids`' K/V: (the blocks, how
        many leading ones already hold it from this pool's cache in the domain of `root`, so
        need no transfer)."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        hits = self._hits_of(token_ids, [], root)[:num_blocks]
        fresh = num_blocks - len(hits)
        if fresh + sum(1 for b in hits if self._ref_counts[b] == 0) > len(self._free):
            raise ValueError(f"cannot reserve {num_blocks} blocks: {len(self._free)} are free")
        for block in hits:
            self._hold(block)
        blocks = hits + self._take(fresh)
        self._reserved.update(blocks)
        return blocks, len(hits)

    def release(self, block_ids: Iterable[int]) -> None:
        """Give back reserved blocks whose transfer will not be attached."""
        blocks = self._check_reserved(block_ids)
        self._reserved.subtract(blocks)
        self._reserved = +self._reserved
        self._decref(blocks)

    def attach(self, seq: Sequence, block_ids: Iterable[int]) -> None:
        """Make reserved blocks the table of `seq`, whose first `num_computed_tokens` tokens
        already have their K/V in them."""
        blocks = self._check_reserved(block_ids)
        if seq.block_table:
            raise ValueError(f"seq {seq.seq_id} already holds blocks")
        needed = self.blocks_needed(seq.num_computed_tokens)
        if not needed <= len(blocks) <= self.blocks_needed(len(seq)):
            raise ValueError(
                f"seq {seq.seq_id} with {seq.num_computed_tokens} computed of {len(seq)} tokens "
                f"needs {needed} to {self.blocks_needed(len(seq))} blocks, got {len(blocks)}"
            )
        self._reserved.subtract(blocks)
        self._reserved = +self._reserved
        seq.block_table = blocks
        self.cache_computed(seq)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (vLLM's `/reset_prefix_cache`); blocks in use stay
        with their holders. Returns how many blocks were forgotten."""
        n = len(self._cached)
        self._cached.clear()
        self._meta.clear()
        self._pending.clear()
        self._evictable.clear()
        self._num_evictable = 0
        self.cached_blocks_by_tenant.clear()
        return n

    def waits_for(self, seq: Sequence) -> bool:
        """Whether `seq`'s cached prefix goes on in blocks a step in flight is computing:
        admitted later, it finds them cached instead of computing them twice."""
        return bool(self.enable_prefix_caching and self._pending) and self._walk(
            seq.token_ids, seq.block_hashes, seq.tenant.cache_root
        )[1]

    # -- internals ---------------------------------------------------------------------------

    def _shortfall(self, seq: Sequence) -> int:
        return max(0, self.blocks_needed(len(seq)) - len(seq.block_table))

    def _grow(self, seq: Sequence, num_blocks: int) -> None:
        if num_blocks > len(self._free):
            raise ValueError(
                f"seq {seq.seq_id} needs {num_blocks} more blocks, {len(self._free)} are free"
            )
        seq.block_table.extend(self._take(num_blocks))

    def _take(self, num_blocks: int) -> list[int]:
        blocks = []
        for _ in range(num_blocks):
            block = self._victim()
            self._ref_counts[block] = 1
            if block in self._meta and block not in self._pending:
                self.evictions_by_tenant[self._meta[block][4]] += 1
            self._evict(block)
            blocks.append(block)
        return blocks

    def _victim(self) -> int:
        """The free block to take next: the LRU one, unless that holds a cached block and a
        tenant is over its cache share; then that tenant's LRU evictable block."""
        block = next(iter(self._free))
        if self._shares and block in self._meta:
            owner = self._most_over_share()
            if owner is not None:
                block = next(iter(self._evictable[owner]))
        del self._free[block]
        self._unlist(block)
        return block

    def _most_over_share(self) -> str | None:
        total, worst, over = self._num_evictable, None, 0.0
        for owner, blocks in self._evictable.items():
            excess = len(blocks) - self._shares.get(owner, 1.0) * total
            if excess > over:
                worst, over = owner, excess
        return worst

    def _list(self, block: int) -> None:
        """A cached block became free: evictable, in its owner's LRU."""
        meta = self._meta.get(block)
        if meta is not None:
            self._evictable.setdefault(meta[4], OrderedDict())[block] = None
            self._num_evictable += 1

    def _unlist(self, block: int) -> None:
        meta = self._meta.get(block)
        if meta is not None:
            blocks = self._evictable[meta[4]]
            del blocks[block]
            self._num_evictable -= 1
            if not blocks:
                del self._evictable[meta[4]]

    def _evict(self, block: int) -> None:
        """Forget what `block` caches (it is not free: off the LRU, not evictable)."""
        self._pending.discard(block)
        meta = self._meta.pop(block, None)
        if meta is not None:
            self.cached_blocks_by_tenant[meta[4]] -= 1
            if self._cached.get(meta[0]) == block:
                del self._cached[meta[0]]

    def _hold(self, block: int) -> None:
        """One more holder of a cached block (taken off the free LRU if nobody held it)."""
        if self._ref_counts[block] == 0:
            del self._free[block]
            self._unlist(block)
        self._ref_counts[block] += 1

    def _decref(self, blocks: list[int]) -> None:
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block in self._pending:  # its step may never have run
                    self._evict(block)
                else:
                    self._list(block)

    def _hits(self, seq: Sequence) -> list[int]:
        if seq.sampling_params.prompt_logprobs is not None:
            return []  # every prompt position's logits are wanted: compute them all
        return self._hits_of(seq.token_ids, seq.block_hashes, seq.tenant.cache_root)

    def _hits_of(
        self, token_ids: Tokens[int], known: list[BlockHash], root: BlockHash = ROOT_HASH
    ) -> list[int]:
        """The cached blocks holding `token_ids`' leading full blocks, all but its last token,
        in the domain of `root`."""
        return self._walk(token_ids, known, root)[0]

    def _walk(
        self, token_ids: Tokens[int], known: list[BlockHash], root: BlockHash
    ) -> tuple[list[int], bool]:
        """(the leading cached blocks with K/V, whether the walk stopped at a pending one)."""
        if not self.enable_prefix_caching or not self._cached:
            return [], False
        bs = self.block_size
        usable = (len(token_ids) - 1) // bs
        hashes = block_hashes(token_ids, bs, known, usable, root)
        hits: list[int] = []
        parent = -1
        for i in range(usable):
            block = self._cached.get(hashes[i])
            if block is None:
                break
            if block in self._pending:
                return hits, True
            _, block_parent, tokens, block_root, _ = self._meta[block]
            if (
                block_parent != parent
                or block_root != root
                or tokens != tuple(token_ids[i * bs : (i + 1) * bs])
            ):
                break  # a hash collision: a different prefix, or another domain's
            hits.append(block)
            parent = block
        return hits, False

    def _check_live(self, blocks: list[int], owner: str) -> None:
        counts: dict[int, int] = {}
        for block in blocks:
            counts[block] = counts.get(block, 0) + 1
        for block, n in counts.items():
            if not 0 <= block < len(self._ref_counts) or self._ref_counts[block] < n:
                raise ValueError(f"{owner}: block {block} is not allocated (double free?)")

    def _check_reserved(self, block_ids: Iterable[int]) -> list[int]:
        blocks = list(block_ids)
        if not blocks or len(set(blocks)) != len(blocks):
            raise ValueError(f"block ids must be a non-empty list without repeats, got {blocks}")
        stray = [b for b in blocks if self._reserved[b] < blocks.count(b)]
        if stray:
            raise ValueError(f"blocks {stray} are not reserved")
        return blocks
