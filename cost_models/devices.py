"""Device and link presets from public datasheets (dense peak, no sparsity).

Peaks are what the hardware can do; the compute model scales them by an achievable
fraction, since no real kernel reaches peak. Each preset has two links: intra-node
(NVLink) and inter-node (InfiniBand). Which one a mesh axis gets depends on the node
layout (Mesh.link_kinds): on one node (the default) every axis is intra-node; on N nodes
an axis is inter-node when any of its process groups spans nodes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

from autopar.core.errors import OptionsError
from autopar.core.links import Link, LinkKind  # noqa: F401 - Link is re-exported (it was defined here)
from autopar.core.mesh import Mesh

TF = 1e12
GBps = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: dict = field(hash=False)  # torch dtype -> FLOP/s
    mem_bw_bytes_per_s: float
    op_overhead_s: float  # launch / dispatch cost of one op
    intra_link: Link = Link(0.0, 0.0)  # axes whose groups stay inside a node
    inter_link: Link = Link(0.0, 0.0)  # axes with a group spanning nodes
    achievable: float = 0.6  # fraction of peak a good kernel reaches

    def flops_per_s(self, dtype: torch.dtype) -> float:
        return self.peak_flops.get(dtype, self.peak_flops[torch.float32]) * self.achievable

    def link(self, kind: LinkKind) -> Link:
        return self.intra_link if kind is LinkKind.INTRA else self.inter_link

    def axis_links(self, mesh_shape: tuple[int, ...], nodes: int = 1,
                   overrides: Optional[Mapping[LinkKind, Link]] = None) -> tuple[Link, ...]:
        """One link per mesh axis for the ranks spread over `nodes` nodes (node-major):
        intra-node where every group of the axis lies inside a node, else inter-node
        (a group partly inside still crosses: its ring runs at the slow hop's pace).
        `overrides` replaces the preset's link of a kind (Options.links). MeshError when
        `nodes` does not divide the mesh's size."""
        chosen = {**{k: self.link(k) for k in LinkKind}, **dict(overrides or {})}
        return tuple(chosen[k] for k in Mesh(tuple(mesh_shape)).link_kinds(nodes))


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
        raise OptionsError(f"unknown device preset {name!r} (Options.device); choose one of {sorted(PRESETS)}, "
                           "or pass a cost_models.devices.DeviceSpec") from None
