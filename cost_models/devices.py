"""Device and link presets from public datasheets (dense peak, no sparsity).

Peaks are what the hardware can do; the compute model scales them by an achievable
fraction, since no real kernel reaches peak."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TF = 1e12
GBps = 1e9


@dataclass(frozen=True)
class Link:
    """alpha-beta model of one mesh axis: a message of b bytes costs alpha + b * beta."""

    alpha_s: float
    beta_s_per_byte: float
    name: str = ""


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: dict = field(hash=False)  # torch dtype -> FLOP/s
    mem_bw_bytes_per_s: float
    op_overhead_s: float  # launch / dispatch cost of one op
    intra_link: Link = Link(0.0, 0.0)  # the last mesh axis (inside a node)
    inter_link: Link = Link(0.0, 0.0)  # earlier mesh axes (across nodes)
    achievable: float = 0.6  # fraction of peak a good kernel reaches

    def flops_per_s(self, dtype: torch.dtype) -> float:
        return self.peak_flops.get(dtype, self.peak_flops[torch.float32]) * self.achievable

    def link(self, axis: int, mesh_ndim: int) -> Link:
        return self.intra_link if axis == mesh_ndim - 1 else self.inter_link


_NV_DTYPES = (torch.bfloat16, torch.float16)

PRESETS: dict[str, DeviceSpec] = {
    # a 2-core CPU running gloo over loopback (what CI and the tests run on)
    "cpu": DeviceSpec(
        "cpu", {torch.float32: 50e9, torch.bfloat16: 25e9, torch.float16: 10e9, torch.float64: 25e9},
        mem_bw_bytes_per_s=10 * GBps, op_overhead_s=5e-6,
        intra_link=Link(60e-6, 1 / (1.0 * GBps), "gloo-loopback"),
        inter_link=Link(60e-6, 1 / (1.0 * GBps), "gloo-loopback"), achievable=1.0),
    # NVIDIA A100 SXM 80GB: 312 TF bf16, 156 TF tf32, 2.0 TB/s; NVLink3 300 GB/s/dir; 200 Gb/s IB
    "a100": DeviceSpec(
        "a100", {**{d: 312 * TF for d in _NV_DTYPES}, torch.float32: 156 * TF, torch.float64: 19.5 * TF},
        mem_bw_bytes_per_s=2039 * GBps, op_overhead_s=5e-6,
        intra_link=Link(8e-6, 1 / (240 * GBps), "nvlink3"), inter_link=Link(15e-6, 1 / (23 * GBps), "ib-200g")),
    # NVIDIA H100 SXM: 989 TF bf16, 494 TF tf32, 3.35 TB/s; NVLink4 450 GB/s/dir; 400 Gb/s IB
    "h100": DeviceSpec(
        "h100", {**{d: 989 * TF for d in _NV_DTYPES}, torch.float32: 494 * TF, torch.float64: 67 * TF},
        mem_bw_bytes_per_s=3350 * GBps, op_overhead_s=4e-6,
        intra_link=Link(6e-6, 1 / (360 * GBps), "nvlink4"), inter_link=Link(12e-6, 1 / (45 * GBps), "ib-400g")),
    # NVIDIA H200 SXM: H100 compute, 4.8 TB/s HBM3e
    "h200": DeviceSpec(
        "h200", {**{d: 989 * TF for d in _NV_DTYPES}, torch.float32: 494 * TF, torch.float64: 67 * TF},
        mem_bw_bytes_per_s=4800 * GBps, op_overhead_s=4e-6,
        intra_link=Link(6e-6, 1 / (360 * GBps), "nvlink4"), inter_link=Link(12e-6, 1 / (45 * GBps), "ib-400g")),
}


def preset(name: str) -> DeviceSpec:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device preset {name!r}; choose one of {sorted(PRESETS)}") from None
