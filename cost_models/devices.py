"""Device and link presets from public datasheets (dense peak, no sparsity).

Peaks are what the hardware can do; the compute model scales them by an achievable
fraction, since no real kernel reaches peak. Each preset has two links: intra-node
(NVLink) and inter-node (InfiniBand). Which one a mesh axis gets depends on the node
layout (Mesh.link_kinds): on one node (the default) every axis is intra-node; on N nodes
an axis is inter-node when any of its process groups spans nodes. A preset knows its
device memory (nominal; the detected device's own where it is read).

Options.device="auto" (the default) reads the accelerator: a CUDA device's name picks its
preset (A100, H100, H200, B200) and its memory is the one torch reports; without CUDA the
CPU preset. register_preset adds a device of your own. The detected device's memory is
also the default memory budget (memory_budget below)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

import torch

from autopar.core.errors import OptionsError
from autopar.core.options import DEVICE_BUDGET_FRACTION, MEMORY_AUTO
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
    memory_bytes: Optional[int] = field(default=None, compare=False)  # device memory per rank (None: unbounded)
    detected: str = field(default="", compare=False)  # the device "auto" read, e.g. "NVIDIA H100 80GB HBM3"
    # collectives run on their own engine beside compute (NCCL on GPUs), so a prefetched
    # parameter gather hides under compute (cost_models/overlap.py); gloo on shared CPU
    # cores competes with compute for the same cores
    collectives_beside_compute: bool = False

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
        intra_link=Link(8e-6, 1 / (240 * GBps), "nvlink3"), inter_link=Link(15e-6, 1 / (23 * GBps), "ib-200g"),
        memory_bytes=80 * 2**30, collectives_beside_compute=True),
    # NVIDIA H100 SXM: 989 TF bf16, 494 TF tf32, 3.35 TB/s; NVLink4 450 GB/s/dir; 400 Gb/s IB
    "h100": DeviceSpec(
        "h100", {**{d: 989 * TF for d in _NV_DTYPES}, torch.float32: 494 * TF, torch.float64: 67 * TF},
        mem_bw_bytes_per_s=3350 * GBps, op_overhead_s=4e-6,
        intra_link=Link(6e-6, 1 / (360 * GBps), "nvlink4"), inter_link=Link(12e-6, 1 / (45 * GBps), "ib-400g"),
        memory_bytes=80 * 2**30, collectives_beside_compute=True),
    # NVIDIA H200 SXM: H100 compute, 4.8 TB/s HBM3e, 141 GB
    "h200": DeviceSpec(
        "h200", {**{d: 989 * TF for d in _NV_DTYPES}, torch.float32: 494 * TF, torch.float64: 67 * TF},
        mem_bw_bytes_per_s=4800 * GBps, op_overhead_s=4e-6,
        intra_link=Link(6e-6, 1 / (360 * GBps), "nvlink4"), inter_link=Link(12e-6, 1 / (45 * GBps), "ib-400g"),
        memory_bytes=141 * 10**9, collectives_beside_compute=True),
    # NVIDIA B200 (HGX): 2.25 PF dense bf16, 8 TB/s HBM3e, 180 GB usable; NVLink5 900 GB/s/dir; 400 Gb/s IB
    "b200": DeviceSpec(
        "b200", {**{d: 2250 * TF for d in _NV_DTYPES}, torch.float32: 1100 * TF, torch.float64: 37 * TF},
        mem_bw_bytes_per_s=8000 * GBps, op_overhead_s=4e-6,
        intra_link=Link(5e-6, 1 / (720 * GBps), "nvlink5"), inter_link=Link(12e-6, 1 / (45 * GBps), "ib-400g"),
        memory_bytes=180 * 10**9, collectives_beside_compute=True),
}
AUTO = "auto"
_GPU_NAMES = (("B200", "b200"), ("H200", "h200"), ("H100", "h100"), ("A100", "a100"))  # device name -> preset


def register_preset(spec: DeviceSpec) -> None:
    """Add (or replace) a preset, found by `Options(device=spec.name)` from then on."""
    PRESETS[spec.name.lower()] = spec


def preset(name: str) -> DeviceSpec:
    if name.lower() == AUTO:
        return detected_device()
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise OptionsError(f"unknown device preset {name!r} (Options.device); choose one of "
                           f"{sorted(PRESETS) + [AUTO]}, or pass a cost_models.devices.DeviceSpec "
                           "(register_preset adds one by name)") from None


def detected_device() -> DeviceSpec:
    """The preset of this process's accelerator, with the memory torch reports for it; the
    CPU preset without CUDA. An unknown GPU is priced as an A100, with a warning."""
    if not torch.cuda.is_available():
        return PRESETS["cpu"]
    index = torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    key = next((k for marker, k in _GPU_NAMES if marker in name.upper()), None)
    if key is None:
        warnings.warn(f"autopar has no cost preset for {name}; it is priced as an A100. Pass Options(device=...) "
                      "with a preset or a DeviceSpec (cost_models.devices.register_preset)", stacklevel=3)
        key = "a100"
    return replace(PRESETS[key], memory_bytes=torch.cuda.get_device_properties(index).total_memory, detected=name)


def memory_budget(budget: "int | str | None", device: DeviceSpec) -> Optional[int]:
    """Options.memory_budget_bytes made a number: "auto" is DEVICE_BUDGET_FRACTION of the
    memory of an accelerator device="auto" detected, and no bound for a CPU or for a named
    preset (an offline plan for another machine); None is no bound."""
    if budget != MEMORY_AUTO:
        return budget  # type: ignore[return-value]
    if device.detected and device.memory_bytes:
        return int(device.memory_bytes * DEVICE_BUDGET_FRACTION)
    return None


def budget_words(budget: "int | str | None", device: DeviceSpec) -> str:
    """What the summary and a MemoryBudgetError say of a budget that came from the device."""
    bound = memory_budget(budget, device)
    if budget != MEMORY_AUTO or bound is None:
        return ""
    return (f"memory budget {bound / 2**30:.1f} GiB: {DEVICE_BUDGET_FRACTION:.0%} of the detected "
            f"{device.detected}'s {device.memory_bytes / 2**30:.1f} GiB")
