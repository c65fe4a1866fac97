"""Sliding-window attention on every attention path (transformers' semantics: the query at
position p sees keys p - w + 1..p) against a dense reference with that mask: the eager torch
code (causal spans, rectangles, decode rows), the C kernels (varlen prefill with chunked and
cached context, decode), the graph regions' rectangles and flat decode lists (torch and
kernel), and unified steps. Contexts span several blocks, windows are smaller than a block,
unaligned to it, equal to a context and larger than every one; no window is the causal
attention it always was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from bucketserve.runtime.attention.attend import (
    flat_attend,
    paged_attend,
    rect_attend,
    unified_attend,
)
from bucketserve.runtime.attention.metadata import rect_mask
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.cpu import kernels
from bucketserve.runtime.worker.graph_regions import decode_layer_region
from bucketserve.runtime.worker.step_inputs import InputBuilder, StepInputs
from tests.runtime.conftest import KERNEL_ISAS, use_kernels

BS, NUM_BLOCKS, HEADS, KV_HEADS, DIM = 16, 64, 6, 2, 64
SCALE = DIM**-0.5
# (tokens already in the pool, new tokens) per sequence: a fresh prompt, a chunk after
# cached context, two decode rows, and a chunk of several query tiles over 10 blocks
STEP = [(0, 45), (37, 30), (70, 1), (5, 1), (90, 70)]
DECODE = [(70, 1), (5, 1), (44, 1), (159, 1)]
# below a block, unaligned, == a prompt (45), == a context (71), past every context
WINDOWS = [1, 7, 21, 45, 71, 1000]


class Pool:
    """Sequences over shuffled blocks of a K/V pool (block 0 is the null block), each with
    its K/V at every position, the context already in the pool, the new tokens' not."""

    def __init__(self, rows: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows, self.dtype = rows, dtype
        shape = (KV_HEADS, NUM_BLOCKS, BS, DIM)
        self.k_cache = torch.zeros(shape, dtype=dtype)
        self.v_cache = torch.zeros(shape, dtype=dtype)
        free = (torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist()
        self.seqs, self.counts, self.kv, self.q = [], [], [], []
        for start, n in rows:
            total = start + n
            seq = Sequence(list(range(total)))
            seq.num_computed_tokens = start
            blocks = -(-total // BS)
            seq.block_table, free = free[:blocks], free[blocks:]
            k = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
            v = torch.randn(total, KV_HEADS, DIM, generator=g).to(dtype)
            for p in range(start):
                block, at = seq.block_table[p // BS], p % BS
                self.k_cache[:, block, at], self.v_cache[:, block, at] = k[p], v[p]
            self.seqs.append(seq)
            self.counts.append(n)
            self.kv.append((k, v))
            self.q.append(torch.randn(n, HEADS, DIM, generator=g).to(dtype))

    def builder(self) -> InputBuilder:
        return InputBuilder(BS, NUM_BLOCKS, 0, 512, torch.device("cpu"))

    def tokens(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The step's q, k, v in its token layout (padding tokens zero) and, per token, its
        (sequence, position), found by the slot it writes (-1, -1: padding)."""
        where = {}
        for i, seq in enumerate(self.seqs):
            start = seq.num_computed_tokens
            for p in range(start, start + self.counts[i]):
                where[seq.block_table[p // BS] * BS + p % BS] = (i, p)
        owner = torch.tensor([where.get(s, (-1, -1)) for s in slots.tolist()])
        q = torch.zeros(len(owner), HEADS, DIM, dtype=self.dtype)
        k = torch.zeros(len(owner), KV_HEADS, DIM, dtype=self.dtype)
        v = torch.zeros_like(k)
        for t, (i, p) in enumerate(owner.tolist()):
            if i >= 0:
                start = self.seqs[i].num_computed_tokens
                q[t], k[t], v[t] = self.q[i][p - start], self.kv[i][0][p], self.kv[i][1][p]
        assert int((owner[:, 0] >= 0).sum()) == sum(self.counts)  # every real token found
        return q, k, v, owner

    def reference(self, owner: torch.Tensor, window: int | None) -> torch.Tensor:
        """Dense float64 attention of each real token over its sequence's keys in
        (p - window, p]."""
        out = torch.zeros(len(owner), HEADS, DIM, dtype=torch.float64)
        per_kv = HEADS // KV_HEADS
        for t, (i, p) in enumerate(owner.tolist()):
            if i < 0:
                continue
            start = self.seqs[i].num_computed_tokens
            q = self.q[i][p - start].double()
            k, v = (x[: p + 1].double() for x in self.kv[i])
            keys = torch.arange(p + 1)
            allowed = keys > p - window if window else torch.ones(p + 1, dtype=torch.bool)
            for h in range(HEADS):
                scores = (k[:, h // per_kv] @ q[h]) * SCALE
                weights = scores.masked_fill(~allowed, float("-inf")).softmax(0)
                out[t, h] = weights @ v[:, h // per_kv]
        return out


def step_slots(step: StepInputs) -> torch.Tensor:
    return step.write_slots if step.write_slots is not None else step.metadata.slot_mapping


def check(pool: Pool, run, slots: torch.Tensor) -> None:
    """`run(q, k, v, window)` (a fresh pool each call: attending writes it) equals the
    reference on every real token, for each window; no window, and a window past every
    context, give exactly the output of the call without one."""
    outputs = {}
    for window in [None, *WINDOWS]:
        fresh = Pool(pool.rows, pool.dtype)
        q, k, v, owner = fresh.tokens(slots)
        out = run(fresh, q, k, v, window)
        real = owner[:, 0] >= 0
        tol = 2e-5 if pool.dtype == torch.float32 else 3e-2
        torch.testing.assert_close(
            out[real].double(), fresh.reference(owner, window)[real], atol=tol, rtol=tol,
            msg=lambda m, w=window: f"sliding_window={w}: {m}",
        )  # fmt: skip
        outputs[window] = out
    assert torch.equal(outputs[1000], outputs[None])
    assert not torch.equal(outputs[21], outputs[None])


def eager_run(pool_, step_of, dtype):
    def run(pool: Pool, q, k, v, window):
        step = step_of(pool)
        step.metadata.prepare(HEADS // KV_HEADS, DIM, dtype)
        attend = paged_attend(pool.k_cache, pool.v_cache, step.metadata)
        if window is None:
            return attend(q, k, v, SCALE)  # the call without the keyword at all
        return attend(q, k, v, SCALE, sliding_window=window)

    return run


@pytest.fixture
def torch_only(monkeypatch):
    """The torch code the kernels replace (as where they cannot build, or off the CPU)."""
    monkeypatch.setattr(kernels, "for_tensors", lambda dtype, device: None)


@pytest.fixture(params=["torch", *(f"kernels-{isa}" for isa in KERNEL_ISAS)])
def use_kernel(request, monkeypatch) -> Iterator[bool]:
    """The graph regions' torch attention, or the C kernels as custom ops (each ISA)."""
    if request.param == "torch":
        yield False
        return
    use_kernels(request.param.partition("-")[2], monkeypatch)
    yield True
    kernels.load.cache_clear()


@pytest.mark.parametrize("rows", [STEP, DECODE], ids=["mixed", "decode"])
def test_eager_torch_paths(torch_only, rows):
    """A mixed step: the fresh prompt as a causal span, the rest as rectangles by query
    length; a decode step: one rectangle of one query per row."""
    pool = Pool(rows, torch.float32)
    step_of = lambda p: p.builder().build(p.seqs, p.counts, None)  # noqa: E731
    step = step_of(pool)
    if rows is STEP:
        assert step.metadata.causal_spans and len(step.metadata.groups) == 2
    check(pool, eager_run(pool, step_of, torch.float32), step_slots(step))


def test_eager_torch_padded_rectangle(torch_only):
    rows = [r for r in STEP if r[1] > 1]
    pool = Pool(rows, torch.float32)
    step_of = lambda p: p.builder().build(p.seqs, p.counts, (4, 72, 12))  # noqa: E731
    check(pool, eager_run(pool, step_of, torch.float32), step_slots(step_of(pool)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [STEP, DECODE], ids=["varlen", "decode"])
def test_eager_kernels(kernel, dtype, rows, monkeypatch):
    """The varlen kernel (tiled prompt chunks over gathered context, one-query rows) and
    the decode kernel, both skipping the blocks before a window; bfloat16 chunks of head
    size 64 take the AMX tiles where the CPU has them."""
    pool = Pool(rows, dtype)
    step_of = lambda p: p.builder().build(p.seqs, p.counts, None)  # noqa: E731
    step = step_of(pool)
    step.metadata.prepare(HEADS // KV_HEADS, DIM, dtype)
    assert step.metadata.varlen == (rows is STEP)
    assert rows is STEP or step.metadata.groups[0].context_lens is not None
    check(pool, eager_run(pool, step_of, dtype), step_slots(step))
    if dtype == torch.bfloat16 and rows is STEP and kernel.tile_unit:
        monkeypatch.setenv("BUCKETSERVE_AMX", "0")  # and the vector path of the same
        check(pool, eager_run(pool, step_of, dtype), step_slots(step))


def test_graph_rectangle_region(use_kernel):
    """`rect_attend` over a padded prompt rectangle as graphs mode lays it out: the mask
    (or the varlen kernel as a custom op) narrowed to each layer's window."""
    rows = [r for r in STEP if r[1] > 1]
    pool = Pool(rows, torch.float32)
    step_of = lambda p: p.builder().build(p.seqs, p.counts, (4, 72, 12))  # noqa: E731

    def run(pool: Pool, q, k, v, window):
        args = step_of(pool).graph_args()
        _, _, qpos, slots, tables, order, qstart, ctx, _ = args
        mask = None if use_kernel else rect_mask(qpos, tables.shape[1] * BS, 3, torch.float32)
        attend = rect_attend(
            pool.k_cache, pool.v_cache, slots, tables, mask, order, qstart, ctx, use_kernel, qpos
        )
        return attend(q, k, v, SCALE, sliding_window=window)

    check(pool, run, step_slots(step_of(pool)))


def flat_args(pool: Pool) -> tuple[torch.Tensor, ...]:
    return pool.builder().build_flat(pool.seqs, pool.counts, (6, 1, 24)).flat


def test_graph_flat_decode_region(use_kernel):
    """`flat_attend` over a decode step's flat block list (padding rows and blocks)."""
    pool = Pool(DECODE, torch.float32)

    def run(pool: Pool, q, k, v, window):
        _, _, slots, *index, _ = flat_args(pool)
        attend = flat_attend(pool.k_cache, pool.v_cache, slots, *index, kernel=use_kernel)
        return attend(q, k, v, SCALE, sliding_window=window)

    check(pool, run, flat_args(pool)[2])


@pytest.mark.parametrize("rows", [STEP, DECODE], ids=["causal", "decode"])
def test_unified_step(rows):
    """A unified step: own tokens, shared context blocks (read by a chunk's tokens) and
    unique ones (read by one decode row), each part under the window."""
    pool = Pool(rows, torch.float32)

    def step_of(p: Pool) -> StepInputs:
        need = p.builder().unified_need(p.seqs, p.counts)
        assert need[3] == (rows is STEP) and need[2] > 0
        return p.builder().build_unified(p.seqs, p.counts, (need[0] + 3, *need[1:]))

    def run(pool: Pool, q, k, v, window):
        _, positions, slots, *index = step_of(pool).flat
        attend = unified_attend(
            pool.k_cache, pool.v_cache, positions, slots, *index, causal=rows is STEP
        )
        return attend(q, k, v, SCALE, sliding_window=window)

    check(pool, run, step_of(pool).flat[2])


class WindowedLayer(nn.Module):
    """A stand-in decoder layer: q, k and v are slices of x; its window is its own int."""

    def __init__(self, sliding_window: int | None) -> None:
        super().__init__()
        self.sliding_window = sliding_window

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, attend) -> torch.Tensor:
        q, k, v = x.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        return attend(q, k, v, SCALE, sliding_window=self.sliding_window)


def test_a_compiled_region_takes_each_layers_window_as_a_constant(use_kernel):
    """One compiled layer region serves layers with different windows (Gemma 3 interleaves
    them): the window is a constant of each trace, so a windowed and a global layer get
    their own graphs and each its own result, as eagerly."""
    torch._dynamo.reset()
    region = torch.compile(decode_layer_region, backend="eager", dynamic=False, fullgraph=True)
    pool = Pool(DECODE, torch.float32)
    _, _, slots, *index, _ = flat_args(pool)
    q, k, v, owner = pool.tokens(slots)
    x = torch.cat([q, k, v], dim=1)
    real = owner[:, 0] >= 0
    for window in [21, None, 7, 21]:
        layer = WindowedLayer(window)
        out = region(layer, x, x, pool.k_cache, pool.v_cache, slots, *index, use_kernel)
        want = pool.reference(owner, window)
        torch.testing.assert_close(out[real].double(), want[real], atol=2e-5, rtol=2e-5)
