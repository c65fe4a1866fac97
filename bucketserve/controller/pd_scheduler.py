"""The P/D scheduler: which decode worker reserves blocks for the next prefill batch, which
prefill worker runs it, and how many blocks that takes. Torch-free and synchronous; every
decision is a return value, so the service's Controller and the simulator drive the same code.

Cache-aware placement (Dynamo's KV router, llm-d's prefix-cache scorer) scores each worker
for a batch as the blocks of its prompts the worker's prefix cache holds (a `PrefixIndex`
of what was sent there) less `load_weight` x the worker's load, both in KV blocks:

- decode: load = the blocks of room it has less than the roomiest worker. A cached block
  is one the batch neither ships nor allocates there; a block less of room is memory
  pressure taken on to reuse it (Dynamo's cost: new blocks + active blocks).
- prefill: load = the blocks it has yet to compute for the batches it was sent. A cached
  block is one it does not compute; a block queued is one computed before the batch starts.

Only workers with room for the whole batch compete, and the least-loaded choice keeps
every tie, so without shared prefixes nothing changes.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from bucketserve.bucket_manager.prefill_batch import PrefillBatch
from bucketserve.bucket_manager.request import BucketRequest
from bucketserve.controller.prefix_index import PrefixIndex, usable_blocks
from bucketserve.runtime.core.block_hash import BlockHash

# controller.remote_prefill: per request by cost, every prompt on a prefill worker (the
# disaggregated topology of old), or none (each decode worker prefills its own, colocated-like)
PREFILL_PATHS = ("auto", "always", "never")


@dataclass(frozen=True)
class PathCosts:
    """What a prompt costs now on each path, from the workers' own measurements (seconds).

    Remote: `prefill_token_s` a prompt token on a prefill worker (None: not measured yet),
    behind `prefill_backlog_tokens` already sent to each; then its KV moves at
    `transfer_token_s` a token, of which a layer-wise handoff (`layerwise`) leaves only the
    last of `num_layers` layers exposed, and the handoff's calls take `handoff_s`.
    `prefill_open`: a prefill worker takes a batch now. Local: the decode worker's engine
    computes it within its steps (at most `step_tokens` prompt tokens a step,
    `decode_token_s` a prompt token; None: priced as on a prefill worker) behind
    `decode_backlog_tokens` queued there; with `decode_running` requests decoding, each
    step also costs `decode_step_s` and each of them waits for those tokens too. That wait
    counts in full even where their TPOT targets could absorb it: the decode worker's time
    is also what every request queued for its room waits on, and priced within the targets'
    slack, `auto` kept prompts local while the prefill workers idled
    (`benchmarks/simulator/conditional.py`)."""

    prefill_token_s: float | None
    prefill_backlog_tokens: float = 0.0
    prefill_open: bool = True
    transfer_token_s: float = 0.0
    layerwise: bool = True
    num_layers: int = 1
    handoff_s: float = 0.0
    decode_token_s: float | None = None
    decode_step_s: float = 0.0
    decode_backlog_tokens: float = 0.0
    decode_running: int = 0
    step_tokens: int = 2048

    def remote_s(self, tokens: float, backlog: float) -> float:
        """Until the first token of a prompt of `tokens` sent to a prefill worker behind
        `backlog` tokens, and its KV on the decode worker."""
        token_s = self.prefill_token_s or 0.0
        moved = tokens * self.transfer_token_s / (self.num_layers if self.layerwise else 1)
        return (backlog + tokens) * token_s + moved + self.handoff_s

    def local_s(self, tokens: float, backlog: float) -> float:
        """The same prompt computed in the decode worker's steps behind `backlog` tokens,
        plus the wait it adds to every request decoding there."""
        token_s = self.decode_token_s or self.prefill_token_s or 0.0
        total = backlog + tokens
        if not self.decode_running:  # an idle engine's steps are the prompts alone
            return total * token_s
        steps = math.ceil(total / self.step_tokens)
        return (
            total * token_s
            + steps * self.decode_step_s
            + self.decode_running * tokens * token_s
        )


class PDScheduler:
    """Decode workers are numbered 0..n-1 and report their *room* (blocks a new batch may
    take) and *load* (sequences running or waiting) with `update`; `pick_decode` returns the
    one with the most room, among equals the least loaded, then the lowest number.

    The rooms sit in a max-heap, re-pushed on every update and skipped lazily when stale,
    so a pick is O(log n) rather than a scan of every worker, which the simulator's
    hundreds of decode workers would pay on every batch. With `cache_aware`, `place_decode`
    and `place_prefill` also visit the workers whose index holds a batch's first blocks.
    """

    def __init__(
        self,
        num_decode: int,
        block_size: int,
        cache_aware: bool = False,
        load_weight: float = 1.0,
    ) -> None:
        if num_decode < 1:
            raise ValueError("the P/D scheduler needs at least one decode worker")
        ok = isinstance(load_weight, (int, float)) and not isinstance(load_weight, bool)
        if not ok or not load_weight >= 0:
            raise ValueError(f"load_weight must be a number >= 0, got {load_weight!r}")
        self.block_size = block_size
        self.cache_aware = cache_aware
        self.load_weight = load_weight
        self._version = [0] * num_decode
        self._heap: list[tuple[int, int, int, int]] = []
        self._room = [0] * num_decode
        self._filed = [False] * num_decode
        self.decode_cache = PrefixIndex(block_size)  # by decode worker number
        self.prefill_cache = PrefixIndex(block_size)  # by whatever names the caller's workers
        self.prefill_queued: dict[Hashable, int] = {}  # blocks each has yet to compute

    # -- decode side -------------------------------------------------------------------------

    def update(self, worker: int, room: int, load: int) -> None:
        """Decode worker `worker`'s room or load changed: file it under the new values."""
        self._version[worker] += 1
        self._room[worker], self._filed[worker] = room, True
        heapq.heappush(self._heap, (-room, load, worker, self._version[worker]))
        if len(self._heap) > 4 * len(self._version) + 64:
            self._heap = [e for e in self._heap if e[3] == self._version[e[2]]]
            heapq.heapify(self._heap)

    def remove(self, worker: int) -> None:
        """`worker` takes no batches until its next `update` (it died: its cache is gone)."""
        self._version[worker] += 1
        self._filed[worker] = False
        self.decode_cache.clear(worker)

    def pick_decode(self) -> int | None:
        """The decode worker with the most room; None when none is filed."""
        heap = self._heap
        while heap and heap[0][3] != self._version[heap[0][2]]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def place_decode(self, batch: PrefillBatch, min_room: int) -> int | None:
        """The decode worker `batch` goes to: `pick_decode`'s, unless a worker with at least
        `min_room` blocks of room scores higher for it (the module's score)."""
        default = self.pick_decode()
        if default is None or not self.cache_aware:
            return default
        room = self._room
        loads = {
            w: room[default] - room[w]
            for w in self.holders(self.decode_cache, batch)
            if self._filed[w] and room[w] >= min_room
        }
        return self.prefer_cached(self.decode_cache, batch, default, loads)

    # -- prefill side ------------------------------------------------------------------------

    @staticmethod
    def pick_prefill(free_blocks: Sequence[int], inflight: Sequence[int], limit: int) -> int | None:
        """The prefill worker (by position) with fewer than `limit` batches in flight and the
        most free blocks, among equals the fewer batches in flight; None when all are busy."""
        open_ = [i for i, n in enumerate(inflight) if n < limit]
        if not open_:
            return None
        return max(open_, key=lambda i: (free_blocks[i], -inflight[i]))

    def place_prefill(
        self,
        batch: PrefillBatch,
        workers: Sequence[Hashable],
        free_blocks: Sequence[int],
        inflight: Sequence[int],
        limit: int,
    ) -> int | None:
        """The prefill worker (by position; `workers` name them in `prefill_cache` and
        `prefill_queued`) that runs `batch`: `pick_prefill`'s, unless an open one with free
        blocks for all its prompts scores higher for it."""
        default = self.pick_prefill(free_blocks, inflight, limit)
        if default is None or not self.cache_aware:
            return default
        need = sum(self.blocks(r.prompt_len) for r in batch.requests)
        held = self.holders(self.prefill_cache, batch)
        position = {w: i for i, w in enumerate(workers)}
        loads = {
            w: self.prefill_queued.get(w, 0)
            for w, i in position.items()
            if w in held and inflight[i] < limit and free_blocks[i] >= need
        }
        loads[workers[default]] = self.prefill_queued.get(workers[default], 0)
        return position[self.prefer_cached(self.prefill_cache, batch, workers[default], loads)]

    def prefill_sent(self, worker: Hashable, blocks: int) -> None:
        """`worker` has `blocks` more to compute (a batch's, less its cached blocks)."""
        self.prefill_queued[worker] = self.prefill_queued.get(worker, 0) + blocks

    def prefill_done(self, worker: Hashable, blocks: int) -> None:
        """`worker` computed (or dropped) a batch sent with `prefill_sent`."""
        left = self.prefill_queued.get(worker, 0) - blocks
        if left > 0:
            self.prefill_queued[worker] = left
        else:
            self.prefill_queued.pop(worker, None)

    # -- the prefix caches -------------------------------------------------------------------

    def prefer_cached(
        self,
        index: PrefixIndex,
        batch: PrefillBatch,
        default: Hashable,
        loads: Mapping[Hashable, float],
    ) -> Hashable:
        """`default` (the least-loaded choice) unless a worker of `loads` (worker -> load in
        blocks; each with room for `batch`) scores higher: the blocks of the batch's prompts
        `index` says it holds less `load_weight` x its load (the default's own load: 0 when
        it is not in `loads`). Among equal others the first in sorted order."""
        best = default
        top = self.cached_blocks(index, default, batch) - self.load_weight * loads.get(default, 0)
        for worker in sorted(loads):
            if worker == default:
                continue
            score = self.cached_blocks(index, worker, batch) - self.load_weight * loads[worker]
            if score > top:
                best, top = worker, score
        return best

    def cached_blocks(self, index: PrefixIndex, worker: Hashable, batch: PrefillBatch) -> int:
        """Blocks of the batch's prompts `worker` would find cached, per `index` (each request
        on its own: requests of one batch do not hit each other's blocks)."""
        bs = self.block_size
        return sum(
            index.matched_blocks(worker, r.block_hashes[: usable_blocks(r.prompt_len, bs)])
            for r in batch.requests
        )

    def uncached_blocks(self, index: PrefixIndex, worker: Hashable, batch: PrefillBatch) -> int:
        """Blocks of the batch's prompts `worker` computes: those its cache lacks."""
        total = sum(self.blocks(r.prompt_len) for r in batch.requests)
        return total - self.cached_blocks(index, worker, batch)

    def expected_cached(
        self, index: PrefixIndex, hashes: Sequence[BlockHash], prompt_len: int
    ) -> int:
        """Leading tokens of a prompt (its full blocks' `hashes`) the best worker of `index`
        holds: the cached length a request is bucketed by when queued."""
        usable = usable_blocks(prompt_len, self.block_size)
        return index.best_match(hashes[:usable]) * self.block_size

    def dispatched(
        self, batch: PrefillBatch, decode: int | None = None, prefill: Hashable | None = None
    ) -> None:
        """`batch` was sent to `decode` (colocated: it computes every prompt) and `prefill`
        (disaggregated: `decode` gets the prompts that go on): their caches hold those
        prompts' blocks next."""
        for r in batch.requests:
            if prefill is not None:
                self.prefill_cache.insert(prefill, r.block_hashes)
            if decode is not None and (prefill is None or not self.ends_at_prefill(r)):
                self.decode_cache.insert(decode, r.block_hashes)

    def reset_prefix_cache(self) -> None:
        """Every worker's prefix cache was reset (`POST /reset_prefix_cache`)."""
        self.decode_cache.reset()
        self.prefill_cache.reset()

    @staticmethod
    def holders(index: PrefixIndex, batch: PrefillBatch) -> set[Hashable]:
        """The workers holding the first block of some prompt of `batch`."""
        held: set[Hashable] = set()
        for r in batch.requests:
            if r.block_hashes and r.prompt_len > index.block_size:
                held |= index.holders(r.block_hashes[0])
        return held

    # -- block accounting --------------------------------------------------------------------

    def blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def need(self, batch: PrefillBatch) -> list[tuple[str, int]]:
        """(request id, blocks its prompt takes) for each request of `batch`, in order."""
        return [(r.request_id, self.blocks(r.prompt_len)) for r in batch.requests]

    def decode_need(self, batch: PrefillBatch) -> list[tuple[str, int]]:
        """`need` of the requests whose KV goes on to a decode worker: not those that end at
        their first token."""
        return [
            (r.request_id, self.blocks(r.prompt_len))
            for r in batch.requests
            if not self.ends_at_prefill(r)
        ]

    @staticmethod
    def ends_at_prefill(request: BucketRequest) -> bool:
        """One sample with one token left to plan for (`max_tokens` left, or the room to
        the model's length): the prefill's token ends it, whatever it is."""
        return request.samples == 1 and request.max_tokens == 1

    @staticmethod
    def fork_blocks(batch: PrefillBatch) -> int:
        """Blocks the decode side takes at once for the extra samples of n > 1 requests: each
        shares the prompt's full blocks (counted once, in `need`) and copies the last one."""
        return sum(r.samples - 1 for r in batch.requests)

    def route(
        self, batch: PrefillBatch, costs: PathCosts, mode: str = "auto"
    ) -> tuple[PrefillBatch | None, PrefillBatch | None]:
        """(local, remote): the requests of `batch` its decode worker prefills itself and
        those a prefill worker prefills, either None when empty. `always` and `never` send
        all one way; `auto` takes, request by request in batch order, the path with the
        smaller cost (`PathCosts.local_s` against `remote_s`, each request's own tokens
        added to the backlog of the path it took). While the prefill side has no
        measurement, `auto` sends all remote (where prompts went until now), or all local
        when no prefill worker takes a batch now. With a measurement and no prefill worker
        open, the remote requests are those cheaper even behind the prefill side's whole
        queue: the caller holds them back for the next free slot."""
        positions = list(range(len(batch)))
        if mode == "never":
            return batch, None
        if mode == "always" or costs.prefill_token_s is None:
            return (batch, None) if mode == "auto" and not costs.prefill_open else (None, batch)
        local, remote = [], []
        prefill_backlog, decode_backlog = costs.prefill_backlog_tokens, costs.decode_backlog_tokens
        for i in positions:
            tokens = batch.requests[i].effective_len
            if costs.local_s(tokens, decode_backlog) <= costs.remote_s(tokens, prefill_backlog):
                local.append(i)
                decode_backlog += tokens
            else:
                remote.append(i)
                prefill_backlog += tokens
        return (
            subset(batch, local) if local else None,
            subset(batch, remote) if remote else None,
        )

    def split_for_pool(
        self, batch: PrefillBatch, free_blocks: int
    ) -> tuple[PrefillBatch | None, PrefillBatch | None]:
        """(head, rest): the longest head of `batch` whose prompts fit `free_blocks` of a
        prefill pool, and what goes back to the queue; either may be None."""
        used, n = 0, 0
        for request in batch.requests:
            used += self.blocks(request.prompt_len)
            if used > free_blocks:
                break
            n += 1
        head = subset(batch, list(range(n))) if n else None
        rest = subset(batch, list(range(n, len(batch)))) if n < len(batch) else None
        return head, rest


def subset(batch: PrefillBatch, keep: list[int]) -> PrefillBatch:
    """`batch` with only the requests at positions `keep`."""
    return dataclasses.replace(
        batch,
        requests=tuple(batch.requests[i] for i in keep),
        order_keys=tuple(batch.order_keys[i] for i in keep),
        kv_blocks_per_request=tuple(batch.kv_blocks_per_request[i] for i in keep),
    )
