"""Names for full KV blocks, chained over the prefix (vLLM's automatic prefix caching scheme;
torch-free).

A block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes up to a collision. A chain starts from its cache domain's root (`domain_root`):
a tenant's, or a domain tenants share, narrowed by a request's `cache_salt`. The block
manager never trusts a hash alone: a hit is checked against the block's tokens, its parent
block and its root, so a collision costs a miss, never wrong K/V, and no hit crosses
domains. Python's hash of a tuple of ints is the same in every process, and the roots are
digests, so the controller can name the blocks a worker will hold without asking it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import cache

BlockHash = int

# The root of the one domain of a service without tenants (and of the offline engine).
ROOT_HASH: BlockHash = hash(("bucketserve", 0))


@cache
def domain_root(domain: str | None = None, salt: str | None = None) -> BlockHash:
    """The hash a chain of cache domain `domain` (None: the single default one) starts from,
    narrowed by `salt`: the same in every process (a digest, not Python's salted str hash)."""
    if domain is None and salt is None:
        return ROOT_HASH
    digest = hashlib.sha256(json.dumps(["bucketserve", domain, salt]).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hash((parent, tuple(token_ids)))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    known: list[BlockHash] | None = None,
    num_blocks: int | None = None,
    root: BlockHash = ROOT_HASH,
) -> list[BlockHash]:
    """The hashes of the full blocks of `token_ids` (at most `num_blocks` of them), chained
    from `root`. `known`, the hashes of a leading part computed before, is extended in
    place rather than recomputed, and returned."""
    hashes = [] if known is None else known
    full = len(token_ids) // block_size
    if num_blocks is not None:
        full = min(full, num_blocks)
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes
