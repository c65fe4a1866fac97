"""The C kernels against the torch code they replace (attention: gather + SDPA)."""

from __future__ import annotations

import pytest
import torch

from bucketserve.runtime.attention.metadata import rect_mask
from bucketserve.runtime.attention.paged_attention import attend_flat, attend_rect
from bucketserve.runtime.core.sequence import Sequence
from bucketserve.runtime.cpu import kernels, mkl_sgemm
from bucketserve.runtime.cpu.gemm import pack_graph_weight
from bucketserve.runtime.cpu.graph_ops import gemm, gemm_panels, paged_decode_flat
from bucketserve.runtime.cpu.panel_gemm import PanelGemm
from bucketserve.runtime.worker.step_inputs import InputBuilder

# Every test runs on each ISA build of the kernels (tests/runtime/conftest.py: KERNEL_ISAS),
# asserted loaded, including those that reach them through the model code.
pytestmark = pytest.mark.usefixtures("kernel")


def pool(kv_heads: int, blocks: int, block_size: int, dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(blocks)
    shape = (kv_heads, blocks, block_size, dim)
    return (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))


def queries(tokens: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
            qkv_view: bool) -> torch.Tensor:
    """`[tokens, heads, dim]` queries: contiguous, or the q heads of a qkv output (rows
    strided by the width of q, k and v), which the kernels read in place."""
    if not qkv_view:
        return torch.randn(tokens, heads, dim).to(dtype)
    q = torch.randn(tokens, heads + 2 * kv_heads, dim).to(dtype)[:, :heads]
    assert not q.is_contiguous()
    return q


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    # GQA ratios the kernel specialises (3, 1, 4, 6) and one it does not (12, at head size 96)
    [(9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 32, 5), (6, 1, 64, 128), (12, 1, 96, 16)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qkv_view", [False, True])
def test_kernel_matches_gather_and_sdpa(
    kernel, heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype,
    qkv_view: bool,
) -> None:
    rows, max_blocks = 7, 6
    k_cache, v_cache = pool(kv_heads, rows * max_blocks + 1, block_size, dim, dtype)
    # ragged rows over shuffled blocks, one row of a single token, unused entries null (0)
    context = torch.tensor([1, block_size, block_size + 1, 3 * block_size - 1, 17, 2, 40])
    context = context.clamp(max=max_blocks * block_size)
    order = torch.randperm(rows * max_blocks, generator=torch.Generator().manual_seed(1)) + 1
    tables = order.view(rows, max_blocks)
    for r, n in enumerate(context.tolist()):
        tables[r, -(-n // block_size) :] = 0
    q = queries(rows, heads, kv_heads, dim, dtype, qkv_view)
    scale = dim**-0.5

    got = kernel.paged_decode(q, k_cache, v_cache, tables, context.to(torch.int32), scale)
    mask = rect_mask((context - 1).view(rows, 1), max_blocks * block_size, heads // kv_heads, dtype)
    want = attend_rect(q, k_cache, v_cache, tables, mask, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_sharing_a_cached_prefix_in_any_order_match_gather_and_sdpa(
    kernel, dtype: torch.dtype
) -> None:
    """Rows of two cached prefixes, interleaved, plus rows of their own: the kernel runs
    rows by their first block, and each row's output must still land in its own place."""
    heads, kv_heads, dim, block_size, max_blocks = 9, 3, 64, 16, 5
    k_cache, v_cache = pool(kv_heads, 40, block_size, dim, dtype)
    prefixes = {0: [1, 2, 3], 1: [4, 5, 6]}
    own, tables, context = iter(range(7, 40)), [], []
    for r in range(9):
        shared = prefixes.get(r % 3, [])  # rows 2, 5, 8 share nothing
        table = shared + [next(own) for _ in range(max_blocks - len(shared))]
        tables.append(table)
        context.append(3 * block_size + 1 + r)
    tables, context = torch.tensor(tables), torch.tensor(context)
    q = queries(len(context), heads, kv_heads, dim, dtype, qkv_view=False)
    scale = dim**-0.5

    got = kernel.paged_decode(q, k_cache, v_cache, tables, context.to(torch.int32), scale)
    mask = rect_mask((context - 1).view(-1, 1), max_blocks * block_size, heads // kv_heads, dtype)
    want = attend_rect(q, k_cache, v_cache, tables, mask, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    # 80: four-vector column blocks and a single-vector rest
    [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 32, 128), (6, 1, 16, 5), (4, 2, 80, 16)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qkv_view", [False, True])
def test_varlen_kernel_matches_gather_and_sdpa_per_sequence(
    kernel, heads: int, kv_heads: int, dim: int, block_size: int, dtype: torch.dtype,
    qkv_view: bool,
) -> None:
    # (new queries, context after the step): decode rows, whole prompts of lengths around
    # the tile sizes, chunks continuing a prompt, a row of one token
    steps = [(1, 40), (37, 37), (130, 200), (5, 300), (64, 64), (1, 1), (90, 90), (2, 129)]
    max_blocks = max(-(-ctx // block_size) for _, ctx in steps)
    k_cache, v_cache = pool(kv_heads, len(steps) * max_blocks + 1, block_size, dim, dtype)
    order = torch.randperm(len(steps) * max_blocks, generator=torch.Generator().manual_seed(2))
    tables = (order + 1).view(len(steps), max_blocks)
    for r, (_, ctx) in enumerate(steps):
        tables[r, -(-ctx // block_size) :] = 0
    starts = torch.tensor([0] + [n for n, _ in steps]).cumsum(0).to(torch.int32)
    context = torch.tensor([ctx for _, ctx in steps], dtype=torch.int32)
    q = queries(int(starts[-1]), heads, kv_heads, dim, dtype, qkv_view)
    scale = dim**-0.5

    got = kernel.paged_prefill(q, k_cache, v_cache, tables, starts, context, scale)
    for s, (n, ctx) in enumerate(steps):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        positions = torch.arange(ctx - n, ctx).view(1, n)
        mask = rect_mask(positions, max_blocks * block_size, heads // kv_heads, dtype)
        want = attend_rect(q[rows], k_cache, v_cache, tables[s : s + 1], mask, scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[rows].float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dim", [64, 128])
def test_bf16_prompt_chunks_on_amx_tiles_match_the_vector_path_and_sdpa(
    kernel, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernel.tile_unit:
        pytest.skip("no AMX here: bfloat16 prompt chunks take the vector path")
    heads, kv_heads, block_size, dtype = 9, 3, 16, torch.bfloat16
    # prompts past several 64-key tiles, a chunk continuing one, and a decode row beside them
    steps = [(300, 300), (70, 450), (1, 33), (129, 129)]
    max_blocks = max(-(-ctx // block_size) for _, ctx in steps)
    k_cache, v_cache = pool(kv_heads, len(steps) * max_blocks + 1, block_size, dim, dtype)
    tables = (torch.arange(len(steps) * max_blocks) + 1).view(len(steps), max_blocks)
    starts = torch.tensor([0] + [n for n, _ in steps]).cumsum(0).to(torch.int32)
    context = torch.tensor([ctx for _, ctx in steps], dtype=torch.int32)
    q = queries(int(starts[-1]), heads, kv_heads, dim, dtype, qkv_view=True)
    scale = dim**-0.5

    tiles = kernel.paged_prefill(q, k_cache, v_cache, tables, starts, context, scale)
    monkeypatch.setenv("BUCKETSERVE_AMX", "0")
    assert not kernel.tile_unit
    vectors = kernel.paged_prefill(q, k_cache, v_cache, tables, starts, context, scale)
    assert not torch.equal(tiles, vectors)  # P in bfloat16 on the tiles: not the same sums
    torch.testing.assert_close(tiles.float(), vectors.float(), atol=2e-2, rtol=2e-2)
    for s, (n, ctx) in enumerate(steps):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        positions = torch.arange(ctx - n, ctx).view(1, n)
        mask = rect_mask(positions, max_blocks * block_size, heads // kv_heads, torch.float32)
        want = attend_rect(q[rows].float(), k_cache.float(), v_cache.float(), tables[s : s + 1],
                           mask, scale)  # fmt: skip
        torch.testing.assert_close(tiles[rows].float(), want, atol=2e-2, rtol=2e-2)


def test_kernels_refuse_a_head_size_they_cannot_vectorise(kernel) -> None:
    assert not kernel.supports(72, 3, 16)
    k_cache, v_cache = pool(1, 2, 4, 72, torch.float32)
    q = torch.randn(2, 1, 72)
    tables = torch.ones(1, 1, dtype=torch.long)
    starts, context = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.paged_prefill(q, k_cache, v_cache, tables, starts, context, 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.paged_decode(q[:1], k_cache, v_cache, tables, context, 1.0)


def test_kernel_refuses_a_head_size_it_cannot_hold(kernel) -> None:
    k_cache, v_cache = pool(1, 2, 4, 512, torch.float32)
    q = torch.randn(1, 1, 512)
    tables = torch.ones(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="up to 256"):
        kernel.paged_decode(q, k_cache, v_cache, tables, torch.tensor([3], dtype=torch.int32), 1.0)


def test_kernel_is_off_with_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    kernels.load.cache_clear()
    try:
        assert kernels.load() is None
    finally:
        monkeypatch.delenv(kernels.ENV_SWITCH)
        kernels.load.cache_clear()
    assert kernels.load() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_the_torch_ops(kernel, dtype: torch.dtype) -> None:
    from bucketserve.runtime.layers.rotary_embedding import RotaryEmbedding, rope_reference

    cos_sin = RotaryEmbedding(32, 64, 10000.0)(torch.tensor([0, 5, 63, 17]), dtype)
    # q and k columns of a qkv output: rows strided by the whole qkv width
    qkv = torch.randn(4, 5 * 32).to(dtype)
    qk = qkv[:, : 3 * 32].view(4, 3, 32)
    want = rope_reference(qk, cos_sin)
    v_before = qkv[:, 3 * 32 :].clone()
    got = kernel.rope_(qk, cos_sin)
    assert got.data_ptr() == qkv.data_ptr()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(qkv[:, 3 * 32 :], v_before)  # v untouched


@pytest.mark.parametrize("size", [576, 100])  # whole vectors, and the scalar path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(kernel, dtype: torch.dtype, size: int) -> None:
    x = (torch.randn(5, size) * 3).to(dtype)
    weight = torch.randn(size).to(dtype)
    want = torch.nn.functional.rms_norm(x, (size,), weight, 1e-5)
    got = kernel.rms_norm(x, weight, 1e-5)
    if dtype == torch.bfloat16:  # rounded to nearest even from the same float32 values
        exact = torch.nn.functional.rms_norm(x.float(), (size,), weight.float(), 1e-5)
        assert (got.float() - exact.to(dtype).float()).abs().max() <= exact.abs().max() / 128
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("size", [1536, 100])  # whole vectors, and a tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(kernel, dtype: torch.dtype, size: int) -> None:
    # gate and up: the two halves of one GEMM output (rows strided), with values far into
    # both tails of silu
    gate_up = (torch.randn(7, 2 * size) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0]).to(dtype)
    gate, up = gate_up[:, :size], gate_up[:, size:]
    want = torch.nn.functional.silu(gate.float()) * up.float()
    got = kernel.silu_mul(gate, up, torch.empty(7, size, dtype=dtype))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    # in place over a contiguous gate
    gate = gate.contiguous()
    assert kernel.silu_mul(gate, up, gate).data_ptr() == gate.data_ptr()
    torch.testing.assert_close(gate.float(), want, atol=tol, rtol=tol)


def test_steps_with_prompt_chunks_take_the_varlen_kernel_and_decode_steps_the_decode_one() -> None:
    builder = InputBuilder(16, 64, 0, 512, torch.device("cpu"))
    decoding, prompt = Sequence(list(range(40))), Sequence(list(range(30)))
    decoding.block_table, decoding.num_computed_tokens = [1, 2, 3], 39
    prompt.block_table = [4, 5]

    mixed = builder.build([decoding, prompt], [1, 30], None).metadata
    mixed.prepare(3, 64, torch.float32)
    assert mixed.varlen and mixed.groups[0].attn_mask is None

    decode = builder.build([decoding], [1], None).metadata
    decode.prepare(3, 64, torch.float32)
    assert not decode.varlen and decode.groups[0].context_lens is not None

    padded = builder.build([prompt], [30], (1, 32, 2)).metadata
    padded.prepare(3, 64, torch.float32)
    assert not padded.varlen and padded.groups[0].attn_mask is not None

    untileable = builder.build([decoding, prompt], [1, 30], None).metadata
    untileable.prepare(3, 72, torch.float32)
    assert not untileable.varlen
    untileable_decode = builder.build([decoding], [1], None).metadata
    untileable_decode.prepare(3, 72, torch.float32)
    assert untileable_decode.groups[0].context_lens is None


@pytest.mark.parametrize("tokens", [5, 300])  # serial, and the threaded loop
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_exactly_what_index_copy_stores(
    kernel, dtype: torch.dtype, tokens: int
) -> None:
    kv_heads, dim, blocks, block_size = 3, 64, 40, 16
    # k and v: column slices of a qkv output, rows strided by the whole width
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * dim).to(dtype)
    k = qkv[:, 9 * dim : (9 + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (9 + kv_heads) * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(blocks * block_size)[:tokens]
    want_k, want_v = pool(kv_heads, blocks, block_size, dim, dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    want_k.view(kv_heads, -1, dim).index_copy_(1, slots, k.transpose(0, 1))
    want_v.view(kv_heads, -1, dim).index_copy_(1, slots, v.transpose(0, 1))
    assert kernel.writes(k, v, got_k, got_v)
    assert not kernel.writes(k, v, got_k, got_v.transpose(1, 2))  # a cache it cannot address
    kernel.write_kv(k, v, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_decode_kernel_matches_attend_flat_over_the_builders_block_list(
    dtype: torch.dtype,
) -> None:
    """The custom op a graphs-mode decode step calls, over the flat block list the input
    builder lays out (padding rows and padding blocks included), equals the torch code of
    the same layout (`attend_flat`) on every row."""
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    contexts = [1, bs, bs + 1, 3 * bs - 1, 40]
    k_cache, v_cache = pool(kv_heads, 64, bs, dim, dtype)
    order = (torch.randperm(63, generator=torch.Generator().manual_seed(3)) + 1).tolist()
    seqs = []
    for ctx in contexts:
        seq = Sequence(list(range(ctx)))
        seq.block_table, order = order[: -(-ctx // bs)], order[-(-ctx // bs) :]
        seq.num_computed_tokens = ctx - 1
        seqs.append(seq)
    step = InputBuilder(bs, 64, 0, 512, torch.device("cpu")).build_flat(
        seqs, [1] * len(seqs), (8, 1, 16)
    )
    _, _, _, block_list, block_rows, valid, starts, context_lens, _ = step.graph_args()
    assert context_lens.tolist() == [*contexts, 0, 0, 0]
    q = queries(8, heads, kv_heads, dim, dtype, qkv_view=True)
    got = paged_decode_flat(q, k_cache, v_cache, block_list, starts, context_lens, dim**-0.5)
    want = attend_flat(q, k_cache, v_cache, block_list, block_rows, valid, dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert not got[len(seqs) :].any()  # rows without blocks attend to nothing


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_panel_gemm_op_matches_linear_with_and_without_a_residual(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g)
    x, residual = torch.randn(rows, 80, generator=g), torch.randn(rows, 96, generator=g)
    panels = PanelGemm(weight).panels
    want = x @ weight.T
    torch.testing.assert_close(gemm_panels(x, panels), want, atol=1e-4, rtol=1e-4)
    kept = residual.clone()
    torch.testing.assert_close(gemm_panels(x, panels, residual), want + kept, atol=1e-4, rtol=1e-4)
    assert torch.equal(residual, kept)  # the op is functional: its residual is not written


@pytest.mark.skipif(not mkl_sgemm.available(), reason="this torch build carries no MKL sgemm")
@pytest.mark.parametrize("rows", [7, 300])
def test_graph_gemm_runs_mkl_at_large_rows_and_the_panels_below(rows: int, monkeypatch) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g)
    x, residual = torch.randn(rows, 80, generator=g), torch.randn(rows, 96, generator=g)
    packed = pack_graph_weight(weight, 32, "kernels", large_rows=256)
    assert packed.large is not None and packed.large_rows == 256
    ran = []
    real = mkl_sgemm.compute
    monkeypatch.setattr(mkl_sgemm, "compute", lambda *args: ran.append(1) or real(*args))
    want = x @ weight.T
    torch.testing.assert_close(gemm(x, packed), want, atol=1e-4, rtol=1e-4)
    kept = residual.clone()
    torch.testing.assert_close(gemm(x, packed, residual), want + kept, atol=1e-4, rtol=1e-4)
    assert torch.equal(residual, kept)
    assert len(ran) == (2 if rows >= 256 else 0)
