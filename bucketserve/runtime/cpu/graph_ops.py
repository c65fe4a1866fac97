"""The CPU kernels a compiled graph calls as custom ops (vLLM's CPU backend does the same):
inductor fuses the elementwise work around them but never traces into them, so a graphs-mode
step runs the eager step's GEMMs (the panel GEMM, MKL's for prompt rectangles) and attention
kernels instead of inductor's own GEMM call over a plain weight and its attention over the
gathered blocks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from bucketserve.runtime.cpu import kernels, mkl_sgemm


class PanelWeight(NamedTuple):
    """A weight packed for a compiled graph's GEMMs (`gemm.pack_graph_weight`): float32
    column panels `[out / 32, in, 32]` for the panel GEMM and, with `large_rows`, MKL's
    packing of the same weight (`mkl_sgemm.PackedSgemm.buffer`), which runs the GEMMs of at
    least that many rows (prefill rectangles), as the eager steps' `RowSplitGemm` does."""

    panels: torch.Tensor
    large: torch.Tensor | None = None
    large_rows: int = 0


def _custom_op(name: str) -> Callable[[Callable[..., Any]], Any]:
    """Registers the decorated function as the custom op `bucketserve::<name>` and returns
    a function that calls the op while a graph is being compiled and the function itself
    otherwise (`.op`: the op, for its fake). An eager step (a padded decode step, a warm-up)
    gains nothing from torch's op dispatch, whose first call imports torch._dynamo: seconds
    of every eager worker's start."""

    def wrap(fn: Callable[..., Any]) -> Any:
        op = torch.library.custom_op(f"bucketserve::{name}", mutates_args=())(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return (op if torch.compiler.is_compiling() else fn)(*args, **kwargs)

        call.op = op
        return call

    return wrap


def is_panels(weight: object) -> bool:
    return isinstance(weight, PanelWeight)


def gemm(
    x: torch.Tensor, weight: PanelWeight, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W^T` (`+ residual`) for `x [..., in]`: MKL's GEMM where `weight` carries its
    packing and `x` has enough rows, the panel GEMM otherwise. A graph's shapes are static,
    so the choice is made once, when the graph is traced."""
    panels = weight.panels
    if weight.large is not None and x.numel() >= weight.large_rows * panels.shape[1]:
        return gemm_mkl(x, weight.large, panels.shape[0] * panels.shape[2], residual)
    return gemm_panels(x, panels, residual)


def _gemm_out(
    x: torch.Tensor, out_features: int, residual: torch.Tensor | None
) -> torch.Tensor:
    if residual is None:
        return x.new_empty((*x.shape[:-1], out_features))
    return residual.clone(memory_format=torch.contiguous_format)


@_custom_op("gemm_panels")
def gemm_panels(
    x: torch.Tensor, panels: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W^T` (`+ residual`) for `x [..., in]`, W packed as `panels`."""
    rows = x.reshape(-1, panels.shape[1]).contiguous()
    out = _gemm_out(x, panels.shape[0] * panels.shape[2], residual)
    if rows.shape[0]:
        kernels.load().gemm_panels(rows, panels, out.view(rows.shape[0], -1), residual is not None)
    return out


@gemm_panels.op.register_fake
def _(x, panels, residual=None):
    return x.new_empty((*x.shape[:-1], panels.shape[0] * panels.shape[2]))


@_custom_op("gemm_mkl")
def gemm_mkl(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W^T` (`+ residual`) for float32 `x [..., in]`, W packed by MKL into `packed`."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = _gemm_out(x, out_features, residual)
    if rows.shape[0]:
        mkl_sgemm.compute(rows, packed, out.view(rows.shape[0], -1), residual is not None)
    return out


@gemm_mkl.op.register_fake
def _(x, packed, out_features, residual=None):
    return x.new_empty((*x.shape[:-1], out_features))


@_custom_op("paged_decode_flat")
def paged_decode_flat(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_list: torch.Tensor,
    block_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """`CpuKernels.paged_decode` over a decode step's flat block list (`sliding_window` 0:
    none)."""
    kernel = kernels.load()
    return kernel.paged_decode(
        q, k_cache, v_cache, block_list, context_lens, scale, block_starts, sliding_window
    )


@paged_decode_flat.op.register_fake
def _(q, k_cache, v_cache, block_list, block_starts, context_lens, scale, sliding_window=0):
    return q.new_empty(q.shape)


@_custom_op("paged_prefill_rect")
def paged_prefill_rect(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_order: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """`CpuKernels.paged_prefill` over a padded rectangle `q [B * Q, heads, dim]`: its real
    tokens (the first `query_start_loc[-1]` of `token_order`) run as one varlen step,
    padding tokens get zeros (`sliding_window` 0: none)."""
    real = int(query_start_loc[-1])
    order = token_order[:real]
    out = kernels.load().paged_prefill(
        q.index_select(0, order), k_cache, v_cache, block_tables, query_start_loc,
        context_lens, scale, sliding_window,
    )  # fmt: skip
    return q.new_zeros(q.shape).index_copy_(0, order, out)


@paged_prefill_rect.op.register_fake
def _(
    q, k_cache, v_cache, block_tables, token_order, query_start_loc, context_lens, scale,
    sliding_window=0,
):  # fmt: skip
    return q.new_empty(q.shape)
