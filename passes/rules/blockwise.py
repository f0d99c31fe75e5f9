"""Run one op shard by shard in one process, as the ranks of a mesh would, and put
the global result back together. Rule tests use it to check that every strategy a
rule offers computes the op's true output.

1. Cut each input into the block every mesh coordinate holds under the strategy
   (partial inputs become random summands that add up to the value).
2. Run the op on each coordinate's blocks, with shape arguments made local.
3. Reassemble each output from the coordinates' results: concatenate shards, sum
   (average, max) partials, check replicas agree; inner mesh axes first.
"""

from __future__ import annotations

from itertools import product
from typing import Any

import torch

from autopar import _compat
from autopar.core.placement import Partial, Replicate, Shard, Spec, TensorMeta, local_chunk
from autopar.passes.rules.local import localize_call
from autopar.passes.rules import OpCall, Strategy, TensorArg


def op_call_of(target: Any, args: tuple, kwargs: dict) -> tuple[OpCall, list[torch.Tensor]]:
    """The OpCall a rule sees for a call with real tensors, and the tensors in order."""
    leaves, spec = _compat.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    it = iter(range(len(tensors)))
    marked = [TensorArg(next(it)) if isinstance(x, torch.Tensor) else x for x in leaves]
    margs, mkwargs = _compat.tree_unflatten(marked, spec)
    out = target(*args, **kwargs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    call = OpCall(target, tuple(margs), dict(mkwargs), tuple(TensorMeta.of(t) for t in tensors),
                  tuple(TensorMeta.of(o) for o in outs))
    return call, tensors


def _summands(x: torch.Tensor, spec: Spec, mesh_shape: tuple[int, ...], gen: torch.Generator) -> dict:
    """coords -> this coordinate's block, with partial axes split into random summands."""
    blocks = {}
    for coords in product(*(range(n) for n in mesh_shape)):
        blocks[coords] = local_chunk(x, Spec(tuple(Replicate() if isinstance(p, Partial) else p
                                                   for p in spec.placements), spec.meta), mesh_shape, coords)
    for axis, p in enumerate(spec.placements):
        if not isinstance(p, Partial) or mesh_shape[axis] == 1:
            continue
        n = mesh_shape[axis]
        noise: dict = {}  # the same summands on every replica of the other axes
        for coords in sorted(blocks):
            if coords[axis] != 0:
                continue
            key = tuple(0 if isinstance(q, Replicate) else c for q, c in zip(spec.placements, coords))
            base = blocks[coords]
            if key not in noise:
                parts = [torch.randn(base.shape, generator=gen).to(base.dtype) for _ in range(n)]
                mean = sum(parts) / n
                noise[key] = [x - mean for x in parts]  # sums to zero over the axis
            for i in range(n):
                c = coords[:axis] + (i,) + coords[axis + 1:]
                centred = noise[key][i]
                if p.reduce == "sum":
                    blocks[c] = base / n + centred
                elif p.reduce == "avg":
                    blocks[c] = base + centred
                else:  # max: one coordinate holds the value, the others something smaller
                    blocks[c] = base if i == 0 else base - centred.abs() - 1
    return blocks


def assemble(blocks: dict, spec: Spec, mesh_shape: tuple[int, ...]) -> torch.Tensor:
    for axis in reversed(range(len(mesh_shape))):
        p = spec.placements[axis]
        merged: dict = {}
        for coords, t in sorted(blocks.items()):
            merged.setdefault(coords[:axis] + coords[axis + 1:], []).append(t)
        out = {}
        for key, parts in merged.items():
            if isinstance(p, Shard):
                out[key] = torch.cat(parts, dim=p.dim)
            elif isinstance(p, Partial):
                stacked = torch.stack([x.to(torch.float64) if x.is_floating_point() else x for x in parts])
                red = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0)}[p.reduce]
                out[key] = red.to(parts[0].dtype)
            else:
                for other in parts[1:]:
                    if not torch.equal(other, parts[0]) and not torch.allclose(other, parts[0], atol=1e-5):
                        raise AssertionError(f"replicated output differs across axis {axis} under {spec}")
                out[key] = parts[0]
        blocks = out
    return blocks[()]


def run_sharded(target: Any, args: tuple, kwargs: dict, strategy: Strategy, mesh_shape: tuple[int, ...],
                seed: int = 0) -> list[torch.Tensor]:
    """The op's global outputs as reassembled from a shard-by-shard run under `strategy`."""
    per_output = run_blocks(target, args, kwargs, strategy, mesh_shape, seed)
    # 3. reassemble
    return [assemble(b, spec, mesh_shape) for b, spec in zip(per_output, strategy.outputs)]


def run_blocks(target: Any, args: tuple, kwargs: dict, strategy: Strategy, mesh_shape: tuple[int, ...],
               seed: int = 0) -> list[dict]:
    """Steps 1 and 2: for each output, mesh coordinates -> that coordinate's block. The
    output specs matter only to ops whose arguments spell a size (rules/local.py SIZE_ARG_OPS)."""
    gen = torch.Generator().manual_seed(seed)
    leaves, tree = _compat.tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    # 1. cut inputs
    blocks = [_summands(leaves[i], spec, mesh_shape, gen) for i, spec in zip(tensor_pos, strategy.inputs)]
    # 2. run per coordinate
    per_output: list[dict] = [dict() for _ in strategy.outputs]
    for coords in product(*(range(n) for n in mesh_shape)):
        local_leaves = list(leaves)
        for k, i in enumerate(tensor_pos):
            local_leaves[i] = blocks[k][coords]
        largs, lkwargs = _compat.tree_unflatten(local_leaves, tree)
        local_target, largs, lkwargs = localize_call(target, tuple(largs), lkwargs, strategy.inputs,
                                                     strategy.outputs, mesh_shape, coords)
        out = local_target(*largs, **lkwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for j, o in enumerate(outs):
            per_output[j][coords] = o
    return per_output
