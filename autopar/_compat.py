"""Every private or version-dependent torch API autopar touches, in one place, so a
torch upgrade (2.11 -> 2.13 and on) is one file's problem."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as _pytree


def tree_flatten(tree: Any) -> tuple[list, Any]:
    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list, spec: Any) -> Any:
    return _pytree.tree_unflatten(leaves, spec)


def treespec_str(spec: Any) -> str:
    return str(spec)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """Sum `input` over the group, keep this rank's chunk of dim 0 in `output`.
    torch 2.13 renamed reduce_scatter_tensor to reduce_scatter_single."""
    import torch.distributed as dist
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, group=group)
