"""Process groups per mesh axis, made once per mesh and reused by every compile.

    Mesh (2, 4) on 8 ranks -> axis 0: groups {0,4} {1,5} {2,6} {3,7}
                              axis 1: groups {0,1,2,3} {4,5,6,7}

Every rank must create every group of an axis, in the same order, even the groups it
is not in (torch.distributed's rule). Groups are cached per (mesh, backend, timeout) on
the live default group, so compiling model after model in one process (a notebook, a
sweep, a service) does not pile up process groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.errors import MeshError, ProcessGroupError
from autopar.core.mesh import Mesh
from autopar.runtime.collectives import AxisComm


@dataclass(frozen=True)
class MeshGroups:
    """This rank's place on the mesh: its group on each axis, and the same groups as a
    torch DeviceMesh (for DTensor and torch.distributed.checkpoint)."""

    mesh: Mesh
    rank: int
    comms: tuple[AxisComm, ...]
    device_mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    world: Any  # the default group these were made under (a new one after re-init needs new groups)

    @property
    def coords(self) -> tuple[int, ...]:
        return self.mesh.coords(self.rank)


_CACHE: dict[tuple, MeshGroups] = {}


def check_world(mesh: Mesh) -> int:
    """This process's rank, after checking that a process group of the mesh's size runs."""
    if not dist.is_available() or not dist.is_initialized():
        raise ProcessGroupError(
            "autopar.compile needs an initialised process group: launch with torchrun "
            "(torchrun --nproc-per-node N script.py) and call torch.distributed.init_process_group(), "
            "or use autopar.plan(...) to plan offline without processes")
    world = dist.get_world_size()
    if world != mesh.size:
        raise MeshError(f"mesh {mesh.shape} has {mesh.size} devices but the process group has {world} ranks; "
                        f"pick a mesh whose sizes multiply to {world}")
    return dist.get_rank()


def mesh_groups(mesh: Mesh, device: torch.device, timeout_s: float) -> MeshGroups:
    """The groups of `mesh` for tensors on `device` (NCCL for CUDA, gloo otherwise)."""
    rank = check_world(mesh)
    backend = "nccl" if device.type == "cuda" else "gloo"
    key = (mesh.shape, backend, float(timeout_s))
    cached = _CACHE.get(key)
    if cached is None or cached.world is not dist.group.WORLD:
        cached = _CACHE[key] = _make_groups(mesh, rank, backend, device, timeout_s)
    return cached


def _make_groups(mesh: Mesh, rank: int, backend: str, device: torch.device, timeout_s: float) -> MeshGroups:
    comms, groups = [], []
    coords = mesh.coords(rank)
    for axis, size in enumerate(mesh.shape):
        mine = None
        for first in range(mesh.size):
            ranks = mesh.axis_ranks(first, axis)
            if ranks[0] != first:
                continue
            group = dist.new_group(list(ranks), backend=backend, timeout=timedelta(seconds=timeout_s))
            if rank in ranks:
                mine = group
        groups.append(mine)
        comms.append(AxisComm(mine, size, coords[axis], mine.group_name))
    device_mesh = DeviceMesh.from_group(groups, device.type, mesh=torch.arange(mesh.size).view(mesh.shape),
                                        mesh_dim_names=tuple(f"axis{a}" for a in range(mesh.ndim)))
    return MeshGroups(mesh, rank, tuple(comms), device_mesh, dist.group.WORLD)
