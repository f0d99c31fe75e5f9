"""Process groups per mesh axis, made once per mesh and reused by every compile.

    Mesh (2, 4) on 8 ranks -> axis 0: groups {0,4} {1,5} {2,6} {3,7}
                              axis 1: groups {0,1,2,3} {4,5,6,7}

Every rank must create every group of an axis, in the same order, even the groups it
is not in (torch.distributed's rule).

A mesh may also be a sub-mesh of the world, given by its global ranks in row-major
order (a pipeline stage's ranks): stage_groups makes the groups of every stage's
sub-mesh on every rank, in one order, and keeps this rank's. Groups are cached per (mesh, backend, timeout) on
the live default group, so compiling model after model in one process (a notebook, a
sweep, a service) does not pile up process groups. The first group made registers the
exit hook that takes every group down before the interpreter ends (teardown.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.core.errors import MeshError, ProcessGroupError
from autopar.core.log import LOG
from autopar.core.mesh import Mesh
from autopar.runtime.collectives import AxisComm
from autopar.runtime.serial_gloo import serial_gloo
from autopar.runtime.teardown import take_down_at_exit


@dataclass(frozen=True)
class MeshGroups:
    """This rank's place on the mesh: its group on each axis, and the same groups as a
    torch DeviceMesh (for DTensor and torch.distributed.checkpoint)."""

    mesh: Mesh
    rank: int
    comms: tuple[AxisComm, ...]
    device_mesh: Any  # torch.distributed.device_mesh.DeviceMesh
    world: Any  # the default group these were made under (a new one after re-init needs new groups)
    ranks: tuple[int, ...] = ()  # global ranks of the mesh, row-major; () for the whole world
    group: Any = None  # the process group spanning the mesh; None for the whole world
    # a gloo group spanning the mesh with the mesh's own timeout (the world's default group
    # has the launcher's): what each call's input agreement runs on (call_agreement.py)
    span: Any = None

    @property
    def coords(self) -> tuple[int, ...]:
        return self.mesh.coords(self.rank)


_CACHE: dict[tuple, MeshGroups] = {}


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets
# the default group's timeout when autopar starts it: rank 0 plans (and may profile) while
# the others wait in its broadcast, which takes minutes for the largest models
START_TIMEOUT = timedelta(minutes=30)


def start_process_group() -> None:
    """Under torchrun with no process group yet, start the default one as the ecosystem
    does: NCCL on this process's GPU (cuda:LOCAL_RANK, made current) where CUDA is
    available, gloo otherwise; one log line says which."""
    if not dist.is_available() or dist.is_initialized() or not all(k in os.environ for k in TORCHRUN_ENV):
        return
    local = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            raise ProcessGroupError(f"local rank {local} has no GPU of its own ({torch.cuda.device_count()} visible): "
                                    "NCCL needs one GPU per rank; launch at most that many processes per node "
                                    "(torchrun --nproc-per-node), or start a gloo group yourself")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=START_TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=START_TIMEOUT)
    LOG.info("started the %s process group: rank %d of %d (torchrun's environment)", dist.get_backend(),
             dist.get_rank(), dist.get_world_size())


def check_world(mesh: Mesh, ranks: tuple[int, ...] = ()) -> int:
    """This process's rank on the mesh, after checking that a process group of the mesh's
    size runs (or, for a sub-mesh of global `ranks`, that the world holds them and this
    process is one of them). Under torchrun without one, it is started here."""
    start_process_group()
    if not dist.is_available() or not dist.is_initialized():
        raise ProcessGroupError(
            "autopar.compile needs a process group: launch with torchrun (torchrun --nproc-per-node N "
            "script.py: autopar then starts one itself) or call torch.distributed.init_process_group() first, "
            "or use autopar.plan(...) to plan offline without processes")
    world = dist.get_world_size()
    if ranks:
        if len(ranks) != mesh.size or not set(ranks) <= set(range(world)) or dist.get_rank() not in ranks:
            raise MeshError(f"sub-mesh {mesh.shape} on global ranks {list(ranks)} does not fit this process "
                            f"(rank {dist.get_rank()} of {world}); give {mesh.size} distinct ranks below {world} "
                            "including this one")
        return ranks.index(dist.get_rank())
    if world != mesh.size:
        raise MeshError(f"mesh {mesh.shape} has {mesh.size} devices but the process group has {world} ranks; "
                        f"pick a mesh whose sizes multiply to {world}")
    return dist.get_rank()


def mesh_groups(mesh: Mesh, device: torch.device, timeout_s: float, ranks: tuple[int, ...] = ()) -> MeshGroups:
    """The groups of `mesh` for tensors on `device` (NCCL for CUDA, gloo otherwise);
    `ranks`: the mesh's global ranks when it is a sub-mesh (made by stage_groups first)."""
    rank = check_world(mesh, ranks)
    backend = _backend(device)
    key = (mesh.shape, backend, float(timeout_s), tuple(ranks))
    cached = _CACHE.get(key)
    if cached is None or cached.world is not dist.group.WORLD:
        if ranks:
            raise ProcessGroupError(f"no groups for sub-mesh {mesh.shape} on ranks {list(ranks)}: every rank must "
                                    "make them together first (autopar.runtime.groups.stage_groups)")
        cached = _CACHE[key] = _make_groups(mesh, rank, backend, device, timeout_s)
    return cached


def stage_groups(mesh: Mesh, axis: int, device: torch.device, timeout_s: float) -> tuple[MeshGroups, Any]:
    """Every rank: the groups of each pipeline stage's sub-mesh (`mesh` without `axis`),
    made in one order on every rank; returns this rank's stage groups and its group
    along `axis` (the ranks of the other stages it sends to and receives from)."""
    rank = check_world(mesh)
    backend = _backend(device)
    rest = tuple(s for a, s in enumerate(mesh.shape) if a != axis) or (1,)
    sub = Mesh(rest)
    mine: Optional[MeshGroups] = None
    for k in range(mesh.shape[axis]):
        ranks = stage_ranks(mesh, axis, k)
        key = (sub.shape, backend, float(timeout_s), ranks)
        cached = _CACHE.get(key)
        if cached is None or cached.world is not dist.group.WORLD:
            cached = _CACHE[key] = _make_groups(sub, ranks.index(rank) if rank in ranks else -1, backend, device,
                                                timeout_s, ranks)
        if rank in ranks:
            mine = cached
    pipe = _make_groups(mesh, rank, backend, device, timeout_s, axes=(axis,)).comms[0].group
    assert mine is not None
    return mine, pipe


def stage_ranks(mesh: Mesh, axis: int, coordinate: int) -> tuple[int, ...]:
    """Global ranks whose coordinate on `axis` is `coordinate`, in row-major order."""
    return tuple(r for r in range(mesh.size) if mesh.coords(r)[axis] == coordinate)


def _backend(device: torch.device) -> str:
    """NCCL for CUDA tensors; for CPU ones gloo with one worker thread per group
    (serial_gloo.py: gloo's default two corrupt the heap with collectives in flight)."""
    return "nccl" if device.type == "cuda" else serial_gloo()


def _make_groups(mesh: Mesh, rank: int, backend: str, device: torch.device, timeout_s: float,
                 ranks: tuple[int, ...] = (), axes: Optional[tuple[int, ...]] = None) -> MeshGroups:
    """Every rank calls this for every mesh; `rank` is this process's place on the mesh,
    -1 when it is not on it (a sub-mesh of another stage): it still takes part in making
    the groups, as torch.distributed requires, but keeps none."""
    take_down_at_exit(_CACHE.clear)
    glob = ranks or tuple(range(mesh.size))
    timeout = timedelta(seconds=timeout_s)
    # the input agreement's group: gloo whatever the backend, so that checking a call's
    # inputs never waits on a GPU stream
    cpu = serial_gloo()
    span = dist.new_group(list(glob), backend=cpu, timeout=timeout) if axes is None else None
    whole = None
    if ranks and axes is None:
        whole = span if backend == cpu else dist.new_group(list(glob), backend=backend, timeout=timeout)
    comms, groups = [], []
    coords = mesh.coords(rank) if rank >= 0 else (0,) * mesh.ndim
    for axis, size in enumerate(mesh.shape):
        if axes is not None and axis not in axes:
            continue
        mine = None
        for first in range(mesh.size):
            members = mesh.axis_ranks(first, axis)
            if members[0] != first:
                continue
            group = dist.new_group([glob[m] for m in members], backend=backend, timeout=timeout)
            if rank in members:
                mine = group
        groups.append(mine)
        comms.append(AxisComm(mine, size, coords[axis], mine.group_name if mine is not None else ""))
    if rank < 0 or axes is not None:
        return MeshGroups(mesh, rank, tuple(comms), None, dist.group.WORLD, glob, whole, span)
    device_mesh = DeviceMesh.from_group(groups, device.type, mesh=torch.tensor(glob).view(mesh.shape),
                                        mesh_dim_names=tuple(f"axis{a}" for a in range(mesh.ndim)))
    return MeshGroups(mesh, rank, tuple(comms), device_mesh, dist.group.WORLD, tuple(ranks), whole, span)
