"""The GEMM over weights kept in GGUF's quantized blocks (`BlockGemm`, `block_gemm_f32`),
on every ISA build: AVX2's byte products, and on x86 the plain build (`x86-64`, no AVX)
whose integer loops are what NEON and other CPUs run. The weights' reference is the `gguf`
package's dequantization (what the float32 expansion loads).

The kernel quantizes x to 8 bits per 32 values (llama.cpp's Q8_0 / Q8_1) before it
multiplies. So x is drawn as integers times 2^-7 with a +-127 in every block: its 8-bit
form is itself, and the product must equal x times the dequantized weight to float
rounding. Random x is compared loosely with the float product, within what 8-bit x costs
(each value moves at most amax / 254 of its block): 0.6 % of the product's norm at worst
over 30 seeds, 1.4 % for Q4_K, whose random minima add sum(x) (and its error) times a
large offset."""

from __future__ import annotations

import platform

import gguf
import numpy as np
import pytest
import torch

from bucketserve.runtime.io.quantized import BLOCK_TYPES, QuantizedTensor
from tests.runtime.conftest import KERNEL_ISAS, use_kernels

ISAS = (*KERNEL_ISAS, "x86-64") if platform.machine() == "x86_64" else KERNEL_ISAS


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=ISAS, scope="module")
def block_gemm(request):
    monkeypatch = pytest.MonkeyPatch()
    use_kernels(request.param, monkeypatch)
    from bucketserve.runtime.cpu import kernels
    from bucketserve.runtime.cpu.block_gemm import BlockGemm

    yield BlockGemm
    monkeypatch.undo()
    kernels.load.cache_clear()


def quantized(block_type: str, rows: int, cols: int, seed: int = 0):
    """A random weight in `block_type`'s blocks, and its float32 as the gguf package
    dequantizes it. The package quantizes the 32-weight types; the K types' blocks are
    random bytes with sane float16 scales (every bit pattern of the rest is a valid block)."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[block_type]
    if block_type in ("Q4_K", "Q6_K"):
        weights, size = gguf.GGML_QUANT_SIZES[kind]
        blocks = rng.integers(0, 256, (rows, cols // weights, size), dtype=np.uint8)
        count = 2 if block_type == "Q4_K" else 1  # Q4_K: d, dmin first; Q6_K: d last
        at = 0 if block_type == "Q4_K" else size - 2
        scales = rng.uniform(0.001, 0.01, (rows, cols // weights, count)).astype(np.float16)
        blocks[..., at : at + 2 * count] = scales.view(np.uint8)
        blocks = blocks.reshape(rows, -1)
    else:
        w = rng.standard_normal((rows, cols), dtype=np.float32)
        blocks = gguf.quants.quantize(w, kind)
    dense = gguf.quants.dequantize(blocks, kind).reshape(rows, cols)
    return QuantizedTensor(torch.from_numpy(blocks.copy()), block_type), torch.from_numpy(dense)


def exact_x(rows: int, cols: int) -> torch.Tensor:
    """x whose 8-bit blocks are exactly x: integers times 2^-7, a +-127 in each block."""
    q = torch.randint(-127, 128, (rows, cols // 32, 32))
    q[..., 0] = 127 * torch.randint(0, 2, (rows, cols // 32)).mul(2).sub(1)
    return q.reshape(rows, cols).float() / 128


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 70])
def test_block_gemm_is_the_dequantized_weight_times_8_bit_x(block_gemm, block_type, rows):
    weight, dense = quantized(block_type, 72, 512)
    gemm = block_gemm(weight)
    assert (gemm.out_features, gemm.in_features) == (72, 512)
    x = exact_x(rows, 512)
    out = gemm(x)
    torch.testing.assert_close(out, (x.double() @ dense.double().T).float(), rtol=1e-5, atol=1e-4)
    residual = torch.randn(rows, 72)
    summed = gemm(x, accumulate=residual.clone())
    torch.testing.assert_close(summed, residual + out, rtol=1e-5, atol=1e-4)
    x = torch.randn(rows, 512)
    float_product = x @ dense.T
    bound = 0.02 if block_type == "Q4_K" else 0.01
    assert (gemm(x) - float_product).norm() / float_product.norm() < bound


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_block_rows_are_the_gguf_packages_dequantized_rows(block_gemm, block_type):
    weight, dense = quantized(block_type, 40, 256, seed=1)
    ids = torch.tensor([[3, 0], [39, 3]])
    assert torch.equal(block_gemm(weight).rows(ids), dense[ids])


def test_parts_of_different_types_fill_their_columns_and_split_into_gemms(block_gemm):
    """q and k in Q5_0, v in Q8_0 (as Gemma 3's file has them), and gate / up halves that
    cut through a part."""
    (q, dq), (k, dk), (v, dv) = (quantized(t, r, 256, s) for t, r, s in
                                 (("Q5_0", 64, 3), ("Q5_0", 32, 4), ("Q8_0", 32, 5)))
    stacked, dense = block_gemm(q, k, v), torch.cat([dq, dk, dv])
    x = exact_x(5, 256)
    want = (x.double() @ dense.double().T).float()
    torch.testing.assert_close(stacked(x), want, rtol=1e-5, atol=1e-4)
    halves = stacked.chunk(2)
    assert [[p.shape for p in h.parts] for h in halves] == [[(64, 256)], [(32, 256), (32, 256)]]
    torch.testing.assert_close(torch.cat([h(x) for h in halves], dim=1), want, rtol=1e-5,
                               atol=1e-4)


@pytest.mark.parametrize("block_type", BLOCK_TYPES)
def test_prompt_chunks_run_on_expanded_panels_with_float_x(block_gemm, block_type):
    """From 256 rows on the weight is expanded for the call and x is not quantized: the
    float product itself."""
    weight, dense = quantized(block_type, 96, 512, seed=6)
    x = torch.randn(300, 512)
    want = (x.double() @ dense.double().T).float()
    torch.testing.assert_close(block_gemm(weight)(x), want, rtol=1e-4, atol=1e-3)
    residual = torch.randn(300, 96)
    torch.testing.assert_close(
        block_gemm(weight)(x, accumulate=residual.clone()), residual + want, rtol=1e-4, atol=1e-3
    )
