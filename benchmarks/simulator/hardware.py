"""Accelerator and link specs for the cost model, with where each number comes from.

Peak numbers are the vendors' datasheet figures (dense bf16 matrix math, HBM
bandwidth, memory). The efficiencies and the per-step overhead are *assumptions*
(typical achieved fractions for large GEMMs and HBM streams, a vLLM-like step
overhead), stated here so they can be changed in one place; the CPU spec is not
a datasheet at all but fitted by `calibrate` to this project's own measured runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from bucketserve.utils.checks import check_number

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator. Times come from `CostModel`, which reads these fields.

    `gemm_m_half`: GEMM efficiency at M tokens is M / (M + gemm_m_half) of the
    large-GEMM rate (0: flat). `kv_traffic`: memory passes over the KV cache an
    attention makes (1 for a fused paged kernel; the CPU path gathers, copies
    and reads it again); `kv_spill_traffic` replaces it once one layer's K/V
    working set outgrows `cache_bytes` (the CPU's last-level cache; infinite on
    accelerators, whose KV always streams from HBM). `dense_attention`:
    attention scores every query against every key of its padded row (a
    masked SDPA) instead of skipping the causal upper triangle (flash attention).
    """

    name: str
    peak_flops: float  # dense bf16 (or the dtype run) matrix FLOP/s
    mem_bandwidth: float  # bytes/s
    mem_bytes: float
    flops_efficiency: float = 0.6
    attn_flops_efficiency: float = 0.4
    bw_efficiency: float = 0.8
    gemm_m_half: float = 0.0
    kv_traffic: float = 1.0
    kv_spill_traffic: float = 1.0
    cache_bytes: float = math.inf
    dense_attention: bool = False
    step_overhead_s: float = 2e-3
    mem_utilization: float = 0.9  # share of memory the engine may use (vLLM's default)
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bandwidth", "mem_bytes"):
            check_number(f"{self.name}: {name}", getattr(self, name), 1.0)
        for name in ("flops_efficiency", "attn_flops_efficiency", "bw_efficiency"):
            check_number(f"{self.name}: {name}", getattr(self, name), 1e-6, 1.0)
        check_number(f"{self.name}: mem_utilization", self.mem_utilization, 1e-6, 1.0)
        check_number(f"{self.name}: gemm_m_half", self.gemm_m_half, 0.0)
        check_number(f"{self.name}: kv_traffic", self.kv_traffic, 1.0)
        check_number(f"{self.name}: kv_spill_traffic", self.kv_spill_traffic, 1.0)
        check_number(f"{self.name}: cache_bytes", self.cache_bytes, 0.0)
        check_number(f"{self.name}: step_overhead_s", self.step_overhead_s, 0.0)

    def with_(self, **changes: object) -> HardwareSpec:
        return replace(self, **changes)


@dataclass(frozen=True)
class LinkSpec:
    """The path KV blocks take from a prefill to a decode accelerator (one direction)."""

    name: str
    bandwidth: float  # bytes/s, one direction
    latency_s: float = 10e-6
    efficiency: float = 0.8
    source: str = ""

    def __post_init__(self) -> None:
        check_number(f"{self.name}: bandwidth", self.bandwidth, 1.0)
        check_number(f"{self.name}: latency_s", self.latency_s, 0.0)
        check_number(f"{self.name}: efficiency", self.efficiency, 1e-6, 1.0)

    def transfer_time(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / (self.bandwidth * self.efficiency)


HARDWARE: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        HardwareSpec(
            "a100-40gb",
            peak_flops=312 * TB,
            mem_bandwidth=1.555 * TB,
            mem_bytes=40 * GB,
            source="NVIDIA A100 datasheet: 312 TFLOP/s bf16 dense, 1,555 GB/s HBM2, 40 GB",
        ),
        HardwareSpec(
            "h100-sxm",
            peak_flops=989 * TB,
            mem_bandwidth=3.35 * TB,
            mem_bytes=80 * GB,
            step_overhead_s=1.5e-3,
            source="NVIDIA H100 SXM datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3, 80 GB",
        ),
        HardwareSpec(
            "h200",
            peak_flops=989 * TB,
            mem_bandwidth=4.8 * TB,
            mem_bytes=141 * GB,
            step_overhead_s=1.5e-3,
            source="NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 4.8 TB/s HBM3e, 141 GB",
        ),
        HardwareSpec(
            "gaudi2",
            peak_flops=432 * TB,
            mem_bandwidth=2.45 * TB,
            mem_bytes=96 * GB,
            step_overhead_s=3e-3,
            source="Intel Gaudi2 whitepaper: ~432 TFLOP/s bf16 MME, 2.45 TB/s HBM2E, 96 GB; "
            "step overhead assumed higher (graph launch on the host)",
        ),
    )
}

LINKS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        LinkSpec(
            "nvlink3", 300 * GB, 5e-6, source="A100 NVLink 3: 12 links x 25 GB/s per direction"
        ),
        LinkSpec(
            "nvlink4", 450 * GB, 5e-6, source="H100 NVLink 4: 18 links x 25 GB/s per direction"
        ),
        LinkSpec("pcie4", 32 * GB, 10e-6, source="PCIe 4.0 x16: 32 GB/s per direction"),
        LinkSpec("roce-100g", 12.5 * GB, 20e-6, source="one 100 GbE RoCE port"),
        LinkSpec(
            "ib-ndr-400g",
            50 * GB,
            5e-6,
            source="one 400 Gb/s NDR InfiniBand port per GPU (as in DGX H100: 8 per node)",
        ),
        LinkSpec(
            "gaudi2-roce-3x100g", 37.5 * GB, 20e-6, source="Gaudi2 scale-out: 3 x 100 GbE RoCE"
        ),
    )
}


def lookup(table: dict, kind: str, name: str):
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(table)}")
    return table[name]
