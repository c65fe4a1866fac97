"""KVCache layout, block export/import across dtypes, and bad block ids."""

from __future__ import annotations

import pytest
import torch

from bucketserve.runtime.worker.kv_cache import KVCache


def make(dtype: torch.dtype = torch.float32, blocks: int = 6) -> KVCache:
    return KVCache(
        num_layers=3, num_blocks=blocks, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype
    )


def fill(cache: KVCache, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn(t.shape, generator=gen))


def test_layout_and_sizes():
    cache = make()
    assert cache.kv.shape == (3, 2, 2, 7, 4, 8)  # [layer, K/V, kv head, block, slot, dim]
    assert cache.null_block == 6
    assert cache.bytes_per_block == 3 * 2 * 4 * 2 * 8 * 4
    assert make(torch.bfloat16).bytes_per_block == 3 * 2 * 4 * 2 * 8 * 2
    k, v = cache.layer(1)
    assert k.shape == (2, 7, 4, 8) and k.is_contiguous() and v.data_ptr() != k.data_ptr()
    k[0, 2, 1, 0] = 5.0
    assert cache.k[1][0, 2, 1, 0] == 5.0  # the layer's own tensor, not a copy
    # one K and one V tensor per layer, none a view of another (graph capture needs that)
    ptrs = {t.untyped_storage().data_ptr() for t in (*cache.k, *cache.v)}
    assert len(ptrs) == 6


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layerwise_round_trip_across_dtypes(dst_dtype):
    src, dst = make(), make(dst_dtype, blocks=9)
    fill(src)
    src_ids, dst_ids = [4, 0, 2], [8, 1, 5]
    for layer in range(3):
        dst.import_blocks(layer, dst_ids, src.export_blocks(layer, src_ids))
    back = make()
    for layer in range(3):
        back.import_blocks(layer, src_ids, dst.export_blocks(layer, dst_ids))
    tol = {torch.float32: 0.0, torch.bfloat16: 1e-2, torch.float16: 1e-3}[dst_dtype]
    expected = src.kv[:, :, :, src_ids]
    torch.testing.assert_close(back.kv[:, :, :, src_ids], expected, atol=tol * 4, rtol=tol)
    untouched = [b for b in range(9) if b not in dst_ids]
    assert not dst.kv[:, :, :, untouched].any()


def test_all_layer_round_trip_keeps_block_order():
    src, dst = make(), make()
    fill(src, seed=1)
    data = src.export_all([3, 1])
    assert data.shape == (3, 2, 2, 4, 2, 8)
    assert torch.equal(data[1, 0, 0, 2, 1], src.kv[1, 0, 1, 3, 2])  # the wire layout
    dst.import_all([0, 5], data)
    assert torch.equal(dst.kv[:, :, :, 0], src.kv[:, :, :, 3])
    assert torch.equal(dst.kv[:, :, :, 5], src.kv[:, :, :, 1])
    data.zero_()  # exported data is a copy
    assert src.kv[:, :, :, 3].any()


def test_bad_imports_raise_and_change_nothing():
    cache = make()
    fill(cache, seed=2)
    before = cache.kv.clone()
    good = cache.export_blocks(0, [1, 2])
    with pytest.raises(ValueError, match=r"block ids \[6\] out of range \[0, 6\)"):
        cache.import_blocks(0, [1, 6], good)
    with pytest.raises(ValueError, match="distinct"):
        cache.import_blocks(0, [1, 1], good)
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4, 2, 8\)"):
        cache.import_blocks(0, [1, 2, 3], good)
    with pytest.raises(ValueError, match="layer 3 out of range"):
        cache.import_blocks(3, [1, 2], good)
    with pytest.raises(ValueError, match="floating-point"):
        cache.import_blocks(0, [1, 2], good.long())
    with pytest.raises(ValueError, match="out of range"):
        cache.export_blocks(0, [-1])
    assert torch.equal(cache.kv, before)
