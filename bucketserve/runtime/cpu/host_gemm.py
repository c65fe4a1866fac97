"""What the CPU GEMMs over a weight packed once by a library outside torch share: the
weight's shape and the call (`x @ weight.T`, or that added into a residual in place)."""

from __future__ import annotations

import torch


class HostGemm:
    """`x @ weight.T` for float32 CPU `x [..., in]` against a weight `[out, in]` packed
    once by a subclass, which computes rows into a 2-D output (`_run`)."""

    out_features: int
    in_features: int

    def __call__(self, x: torch.Tensor, accumulate: torch.Tensor | None = None) -> torch.Tensor:
        """The product, or `accumulate + product` written into `accumulate` (a contiguous
        `[..., out]` float32 tensor) when one is given."""
        rows = x.reshape(-1, self.in_features).contiguous()
        out = accumulate
        if out is None:
            out = x.new_empty((*x.shape[:-1], self.out_features))
        if rows.shape[0]:
            self._run(rows, out.view(-1, self.out_features), accumulate is not None)
        return out

    def _run(self, rows: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        """`out [M, out] (+)= rows [M, in] . weight^T`, both contiguous."""
        raise NotImplementedError


class RowSplitGemm(HostGemm):
    """One weight packed twice: GEMMs of fewer than `large_rows` rows (decode batches) run
    on `small`, the others (prefill chunks) on `large`."""

    def __init__(self, small: HostGemm, large: HostGemm, large_rows: int) -> None:
        self.small, self.large, self.large_rows = small, large, large_rows
        self.out_features, self.in_features = small.out_features, small.in_features

    def _run(self, rows: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        gemm = self.large if rows.shape[0] >= self.large_rows else self.small
        gemm._run(rows, out, accumulate)
