"""What the controller believes each worker's prefix cache holds: the block hashes of the
prompts it sent there lately. Dynamo's KV router learns this from the workers' cache
events; here a dispatch is the event, so the index needs no message from a worker and the
simulator runs it as the service does. Torch-free.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from bucketserve.runtime.core.block_hash import BlockHash


def usable_blocks(prompt_len: int, block_size: int) -> int:
    """Leading full blocks a prompt can find cached: never the one holding its last token,
    which the prefill computes to sample (the block manager's rule)."""
    return (prompt_len - 1) // block_size


class PrefixIndex:
    """Per worker, an LRU of the block hashes sent there, bounded by the worker's block
    count (`set_capacity`; unbounded until told), so the oldest prefixes fall out about
    when the worker's own LRU would evict them. A hash maps back to the workers holding
    it, so a lookup visits only the workers that hold a request's first block."""

    def __init__(self, block_size: int) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self._blocks: dict[Hashable, OrderedDict[BlockHash, None]] = {}
        self._capacity: dict[Hashable, int] = {}
        self._holders: dict[BlockHash, set[Hashable]] = {}

    def __len__(self) -> int:
        """Block hashes held, over every worker."""
        return sum(len(blocks) for blocks in self._blocks.values())

    def num_blocks(self, worker: Hashable) -> int:
        return len(self._blocks.get(worker, ()))

    def set_capacity(self, worker: Hashable, num_blocks: int) -> None:
        """`worker` caches at most `num_blocks` blocks; the oldest beyond go now."""
        if self._capacity.get(worker) == num_blocks:
            return
        self._capacity[worker] = max(0, num_blocks)
        self._trim(worker)

    def insert(self, worker: Hashable, hashes: Sequence[BlockHash]) -> None:
        """`worker` was sent a prompt whose full blocks are `hashes` (in prompt order): it
        computes or receives them, and its cache holds them next. The last block is filed
        first, so a prefix ages from its tail, as the worker frees it."""
        if not hashes:
            return
        blocks = self._blocks.setdefault(worker, OrderedDict())
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                self._holders.setdefault(h, set()).add(worker)
        self._trim(worker)

    def matched_blocks(self, worker: Hashable, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of `hashes` `worker` holds."""
        blocks = self._blocks.get(worker)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def matched_tokens(self, worker: Hashable, hashes: Sequence[BlockHash]) -> int:
        return self.matched_blocks(worker, hashes) * self.block_size

    def holders(self, first: BlockHash) -> set[Hashable]:
        """The workers holding the block `first` (a prompt's first block)."""
        return self._holders.get(first, set())

    def best_match(self, hashes: Sequence[BlockHash]) -> int:
        """The most leading blocks of `hashes` any one worker holds."""
        if not hashes:
            return 0
        return max((self.matched_blocks(w, hashes) for w in self.holders(hashes[0])), default=0)

    def clear(self, worker: Hashable) -> None:
        """`worker` lost its cache (it died, or was reset)."""
        for h in self._blocks.pop(worker, ()):
            self._unhold(h, worker)

    def reset(self) -> None:
        """Every worker's cache was reset."""
        self._blocks.clear()
        self._holders.clear()

    def _trim(self, worker: Hashable) -> None:
        blocks, cap = self._blocks.get(worker), self._capacity.get(worker)
        if blocks is None or cap is None:
            return
        while len(blocks) > cap:
            h, _ = blocks.popitem(last=False)
            self._unhold(h, worker)

    def _unhold(self, h: BlockHash, worker: Hashable) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]
