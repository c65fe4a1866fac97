"""Names for full KV blocks, chained over the prefix (vLLM's automatic prefix caching scheme;
torch-free).

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes up to a collision. The block manager never trusts a hash alone: a hit is checked
against the block's tokens and its parent block. Python's hash of a tuple of ints is the same
in every process, so the controller can name the blocks a worker will hold without asking it.
"""

from __future__ import annotations

from collections.abc import Sequence

BlockHash = int

# The parent of a sequence's first block; any fixed value works.
ROOT_HASH: BlockHash = hash(("bucketserve", 0))


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hash((parent, tuple(token_ids)))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    known: list[BlockHash] | None = None,
    num_blocks: int | None = None,
) -> list[BlockHash]:
    """The hashes of the full blocks of `token_ids` (at most `num_blocks` of them). `known`,
    the hashes of a leading part computed before, is extended in place rather than
    recomputed, and returned."""
    hashes = [] if known is None else known
    full = len(token_ids) // block_size
    if num_blocks is not None:
        full = min(full, num_blocks)
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(len(hashes), full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
