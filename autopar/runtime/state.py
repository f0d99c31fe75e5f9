"""Parameters and gradients across shards: global gradient-norm clipping, full state
dicts, and sharded checkpoints through torch.distributed.checkpoint.

A shard's Spec says which mesh axes split it: its values are distinct across those
axes and identical across the others, so sums over the whole tensor are reduced over
the splitting axes only."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from autopar.core.mesh import Mesh
from autopar.core.placement import R, Partial, Shard, Spec, block_index, local_chunk, split_blocks
from autopar.passes.plan.state_layouts import tied_groups
from autopar.runtime.collectives import AxisComm, all_gather, all_reduce


class ShardedModel(Protocol):
    """What these functions read of a ParallelModule (autopar/runtime/module.py)."""

    mesh: Mesh
    coords: tuple[int, ...]
    comms: tuple[AxisComm, ...]
    device: torch.device
    device_mesh: Any
    source_model: nn.Module
    state_tensors: dict[str, torch.Tensor]  # state-dict name -> this rank's shard (tied names share one)
    state_specs: dict[str, Spec]  # state-dict name -> the shard's Spec
    loaded: bool


def _split_axes(spec: Spec) -> tuple[int, ...]:
    return tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Shard))


def unique_shards(pm: "ShardedModel"):
    """(name, tensor, spec) once per shard (tied names share one shard, under the first name)."""
    for group in tied_groups(pm.state_specs, pm.state_tensors.__getitem__):
        yield group[0], pm.state_tensors[group[0]], pm.state_specs[group[0]]


@torch.no_grad()
def clip_grad_norm_(pm: "ShardedModel", max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    norm_type = float(norm_type)
    by_axes: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for _, t, spec in unique_shards(pm):
        if isinstance(t, torch.nn.Parameter) and t.grad is not None:
            by_axes.setdefault(_split_axes(spec), []).append(t.grad)
    inf = norm_type == float("inf")
    total = torch.zeros((), dtype=torch.float64)
    for axes, grads in by_axes.items():
        if inf:
            part = torch.stack([g.detach().abs().max().double() for g in grads]).max()
        else:
            part = sum(g.detach().double().abs().pow(norm_type).sum() for g in grads)
        for a in axes:
            part = all_reduce(part.reshape(1), pm.comms[a], "max" if inf else "sum")[0]
        total = torch.maximum(total, part) if inf else total + part
    norm = total if inf else total.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grads in by_axes.values():
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return norm.float()


def gather_full(local: torch.Tensor, spec: Spec, pm: "ShardedModel") -> torch.Tensor:
    """The whole tensor from this rank's block (inner mesh axes first). An uneven shard
    (one axis only, autopar/core/placement.py) is gathered at its global size."""
    out = local
    for axis in reversed(range(len(spec.placements))):
        p = spec.placements[axis]
        if isinstance(p, Shard):
            alone = spec.shard_axes(p.dim) == (axis,)
            out = all_gather(out, p.dim, pm.comms[axis], spec.meta.shape[p.dim] if alone else None, p.unit)
        elif isinstance(p, Partial):
            out = all_reduce(out, pm.comms[axis], p.reduce)
    return out


@torch.no_grad()
def full_state_dict(pm: "ShardedModel") -> dict[str, torch.Tensor]:
    out = {}
    for name in pm.source_model.state_dict():
        if name in pm.state_specs:
            out[name] = gather_full(pm.state_tensors[name].detach(), pm.state_specs[name], pm).clone()
        else:  # state the traced graph never read: unchanged from the original model
            out[name] = pm.source_model.state_dict()[name].detach().clone()
    return out


@torch.no_grad()
def load_full_state_dict(pm: "ShardedModel", state_dict: dict[str, torch.Tensor]) -> None:
    missing = [n for n in pm.state_specs if n not in state_dict]
    if missing:
        raise KeyError(f"state dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}; it must hold every "
                       "parameter and buffer of the compiled model (the keys of model.state_dict())")
    for name, t, spec in unique_shards(pm):
        full = state_dict[name]
        if tuple(full.shape) != spec.meta.shape:
            raise ValueError(f"state dict entry {name} has shape {tuple(full.shape)}, the model's is {spec.meta.shape}")
        t.data = local_chunk(full, spec, pm.mesh.shape, pm.coords).to(pm.device, t.dtype).clone()


@torch.no_grad()
def load_safetensors(pm: "ShardedModel", path: str) -> None:
    from safetensors import safe_open  # optional: only this loader needs it
    with safe_open(path, framework="pt", device="cpu") as f:
        names = set(f.keys())
        for group in tied_groups(pm.state_specs, pm.state_tensors.__getitem__):
            present = [n for n in group if n in names]
            if not present:
                raise KeyError(f"safetensors file {path} has no tensor {group[0]} (nor its tied names {group[1:]})")
            spec = pm.state_specs[present[0]]
            block = f.get_slice(present[0])[block_index(spec, pm.mesh.shape, pm.coords)]
            holder = pm.state_tensors[present[0]]
            holder.data = block.to(pm.device, holder.dtype).contiguous()


def _dtensor_placements(spec: Spec) -> list:
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    return [TS(p.dim) if isinstance(p, Shard) else TR() for p in spec.placements]


def as_dtensor(local: torch.Tensor, spec: Spec, device_mesh: Any) -> Any:
    """This rank's block of a tensor laid out as `spec`, as a DTensor (no copy, no check):
    what torch.distributed.checkpoint saves once per distinct block and reshards on load."""
    from torch.distributed.tensor import DTensor
    shape = torch.Size(spec.meta.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, device_mesh, _dtensor_placements(spec), shape=shape, stride=stride,
                              run_check=False)


def _unit_axes(spec: Spec) -> tuple[int, ...]:
    return tuple(a for a, p in enumerate(spec.placements) if isinstance(p, Shard) and p.unit != 1)


def checkpoint_spec(spec: Spec) -> Spec:
    """The layout a state tensor is checkpointed in: its own, except that a block of whole
    groups (Shard.unit, S(d/u): attention heads split unevenly) is saved whole along that
    axis, since a DTensor Shard can only describe torch.chunk's blocks. Any mesh can then
    load it, and even shards are saved exactly as before."""
    units = _unit_axes(spec)
    if not units:
        return spec
    return Spec(tuple(R if a in units else p for a, p in enumerate(spec.placements)), spec.meta)


def to_checkpoint(local: torch.Tensor, spec: Spec, pm: "ShardedModel") -> Any:
    """This rank's block as the DTensor DCP saves (checkpoint_spec: whole-group blocks are
    first gathered along their axis, which every rank of that axis does alike)."""
    for axis in _unit_axes(spec):
        p = spec.placements[axis]
        local = all_gather(local, p.dim, pm.comms[axis], spec.meta.shape[p.dim], p.unit)
    return as_dtensor(local, checkpoint_spec(spec), pm.device_mesh)


def checkpoint_target(spec: Spec, pm: "ShardedModel", dtype: torch.dtype) -> Any:
    """A zero DTensor of the block DCP loads for a tensor laid out as `spec`."""
    shape = checkpoint_spec(spec).local_shape_at(pm.mesh.shape, pm.coords)
    return as_dtensor(torch.zeros(shape, dtype=dtype, device=pm.device), checkpoint_spec(spec), pm.device_mesh)


def from_checkpoint(block: torch.Tensor, spec: Spec, pm: "ShardedModel") -> torch.Tensor:
    """This rank's own block of what DCP loaded into a checkpoint_spec target."""
    for axis in _unit_axes(spec):
        p = spec.placements[axis]
        block = split_blocks(block, pm.mesh.shape[axis], p.dim, p.unit)[pm.coords[axis]]
    return block


def sharded_state_dict(pm: "ShardedModel") -> dict[str, Any]:
    """Each state tensor as the DTensor block this rank checkpoints (what every DCP save
    and load of autopar goes through; checkpoint_spec says which layout that is)."""
    out = {}
    for name, spec in pm.state_specs.items():
        t = pm.state_tensors[name]
        local_shape = spec.local_shape_at(pm.mesh.shape, pm.coords)
        if tuple(t.shape) != local_shape:  # compiled on meta: give the loader real memory to fill
            t.data = torch.empty(local_shape, dtype=t.dtype, device=pm.device)
        out[name] = to_checkpoint(t.detach(), spec, pm)
    return out


@torch.no_grad()
def load_checkpoint(pm: "ShardedModel", path: str) -> None:
    import torch.distributed.checkpoint as dcp
    target = sharded_state_dict(pm)
    dcp.load(target, checkpoint_id=path)
    for name, dt in target.items():
        pm.state_tensors[name].copy_(from_checkpoint(dt.to_local(), pm.state_specs[name], pm))
    dist.barrier()


class ShardedStateMethods:
    """The training utilities of ParallelModule (kept here, beside their implementations)."""

    def _require_own_shards(self, what: str) -> None:
        """ParallelModule refuses here when its shards live elsewhere (a pipelined plan's stages)."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of all shards by their global norm, as
        torch.nn.utils.clip_grad_norm_ does on the unsharded model; returns that norm."""
        self._require_own_shards("clip_grad_norm_")
        return clip_grad_norm_(self, max_norm, norm_type)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered whole (on every rank), under the original
        model's state-dict names: loadable with model.load_state_dict."""
        return full_state_dict(self)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy this rank's block of each full tensor into its shard."""
        load_full_state_dict(self, state_dict)
        self.loaded = True

    def sharded_state_dict(self) -> dict[str, Any]:
        """Shards as DTensors on `self.device_mesh`, for torch.distributed.checkpoint."""
        self._require_own_shards("sharded_state_dict")
        return sharded_state_dict(self)

    def load_safetensors(self, path: str) -> None:
        """Read this rank's block of every tensor from a safetensors file, slice by slice:
        the whole model is never in this rank's memory."""
        self._require_own_shards("load_safetensors")
        load_safetensors(self, path)
        self.loaded = True

    def save_checkpoint(self, path: str) -> None:
        """Sharded save through torch.distributed.checkpoint (each rank writes its shards)."""
        import torch.distributed.checkpoint as dcp
        self._require_own_shards("save_checkpoint")
        dcp.save(self.sharded_state_dict(), checkpoint_id=path)

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint saved by save_checkpoint on any mesh or plan of this model."""
        self._require_own_shards("load_checkpoint")
        load_checkpoint(self, path)
        self.loaded = True
