"""Ops that move, merge, split or slice dims without arithmetic. All are linear, so
Partial passes through; a shard passes when its dim survives as a whole (or is the
outermost non-unit dim of a merged group)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.core.placement import P, Partial, R, Shard
from autopar.passes.rules._helpers import dim_map_rules, norm_dim
from autopar.passes.rules.registry import AxisRule, OpCall, register

aten = torch.ops.aten


def view_dim_map(src: tuple[int, ...], dst: tuple[int, ...]) -> dict[int, int]:
    """Input dim -> output dim for a reshape, where sharding the input dim equals
    sharding the output dim: both are the first non-unit dim of matching groups."""
    return {g.src_dim: g.dst_dim for g in view_groups(src, dst)}


@dataclass(frozen=True)
class ViewGroup:
    """Dims of a reshape's input and output that hold the same elements: the first
    non-unit dim of each side, and the product of the dims after it (a head's size when
    [.., 320] becomes [.., 5, 64]: src_inner 1, dst_inner 64)."""

    src_dim: int
    dst_dim: int
    src_inner: int
    dst_inner: int


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[ViewGroup]:
    """The matching dim groups of a reshape from `src` to `dst` (see ViewGroup)."""
    groups: list[ViewGroup] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        a, b = src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                if i >= len(src):
                    return groups
                gi.append(i)
                a *= src[i]
            else:
                j += 1
                if j >= len(dst):
                    return groups
                gj.append(j)
                b *= dst[j]
        first_i = next((k for k in gi if src[k] != 1), None)
        first_j = next((k for k in gj if dst[k] != 1), None)
        if first_i is not None and first_j is not None:
            groups.append(ViewGroup(first_i, first_j, a // src[first_i], b // dst[first_j]))
        i += 1
        j += 1
    return groups


def group_units(g: ViewGroup) -> tuple[int, int] | None:
    """Units (input, output) under which splitting the two dims of a group cuts the same
    elements: splitting [.., 320] in whole heads of 64 (unit 64) is splitting the heads of
    [.., 5, 64] (unit 1), and the reverse for the merge; None where neither side's inner
    product divides the other's."""
    if g.dst_inner % g.src_inner == 0:
        return g.dst_inner // g.src_inner, 1
    if g.src_inner % g.dst_inner == 0:
        return 1, g.src_inner // g.dst_inner
    return None


# squeezing and unsqueezing are reshapes that only add or drop unit dims
@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
          aten.unflatten.int, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def view(call: OpCall) -> list[AxisRule]:
    """Even shards map dim to dim; a group that splits or merges a dim also maps whole
    units (heads) to whole units, which is what an uneven split of heads needs (expand
    drops the unit where the split is even)."""
    groups = view_groups(call.inputs[0].shape, call.outputs[0].shape)
    rules = dim_map_rules(call, {g.src_dim: g.dst_dim for g in groups})
    for g in groups:
        units = group_units(g)
        if units is not None and units != (1, 1):
            rules.append(AxisRule((Shard(g.src_dim, units[0]),), (Shard(g.dst_dim, units[1]),)))
    return rules


@register(aten.transpose.int)
def transpose(call: OpCall) -> list[AxisRule]:
    n = call.inputs[0].ndim
    a, b = norm_dim(call.args[1], n), norm_dim(call.args[2], n)
    perm = list(range(n))
    perm[a], perm[b] = perm[b], perm[a]
    return dim_map_rules(call, {perm[o]: o for o in range(n)})


@register(aten.t.default)
def t(call: OpCall) -> list[AxisRule]:
    n = call.inputs[0].ndim
    return dim_map_rules(call, {i: n - 1 - i for i in range(n)})


@register(aten.permute.default)
def permute(call: OpCall) -> list[AxisRule]:
    n = call.inputs[0].ndim
    perm = [norm_dim(d, n) for d in call.args[1]]
    return dim_map_rules(call, {perm[o]: o for o in range(n)})


@register(aten.expand.default)
def expand(call: OpCall) -> list[AxisRule]:
    src, dst = call.inputs[0].shape, call.outputs[0].shape
    lead = len(dst) - len(src)
    rules = dim_map_rules(call, {i: i + lead for i in range(len(src)) if src[i] == dst[i + lead] and src[i] > 1})
    # a broadcast dim can be produced already split: each rank expands to its chunk
    for o in range(len(dst)):
        i = o - lead
        if dst[o] > 1 and (i < 0 or src[i] == 1):
            rules.append(AxisRule((R,), (Shard(o),)))
    return rules


def _slice_is_full(call: OpCall, dim: int) -> bool:
    return call.inputs[0].shape[dim] == call.outputs[0].shape[dim]


@register(aten.slice.Tensor)
def slice_(call: OpCall) -> list[AxisRule]:
    n = call.inputs[0].ndim
    dim = norm_dim(call.arg(1, "dim", 0), n)
    full = _slice_is_full(call, dim) and call.arg(2, "start", 0) in (0, None) and call.arg(4, "step", 1) == 1
    return dim_map_rules(call, {d: d for d in range(n) if d != dim or full})


@register(aten.select.int)
def select(call: OpCall) -> list[AxisRule]:
    n = call.inputs[0].ndim
    dim = norm_dim(call.args[1], n)
    return dim_map_rules(call, {d: (d if d < dim else d - 1) for d in range(n) if d != dim})


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def split(call: OpCall) -> list[AxisRule]:
    n = call.inputs[0].ndim
    dim = norm_dim(call.arg(2 if call.target != aten.unbind.int else 1, "dim", 0), n)
    if call.target == aten.unbind.int:
        return dim_map_rules(call, {d: (d if d < dim else d - 1) for d in range(n) if d != dim})
    return dim_map_rules(call, {d: d for d in range(n) if d != dim})


@register(aten.cat.default)
def cat(call: OpCall) -> list[AxisRule]:
    out = call.outputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), out.ndim)
    k = len(call.inputs)
    rules = [AxisRule((R,) * k, (R,))]
    if all(m.ndim == out.ndim for m in call.inputs):
        rules += [AxisRule((Shard(d),) * k, (Shard(d),)) for d in range(out.ndim) if d != dim]
    if out.dtype.is_floating_point:
        rules += [AxisRule((P,) * k, (P,)), AxisRule((Partial("avg"),) * k, (Partial("avg"),))]
    return rules


@register(aten.stack.default)
def stack(call: OpCall) -> list[AxisRule]:
    out = call.outputs[0]
    dim = norm_dim(call.arg(1, "dim", 0), out.ndim)
    k = len(call.inputs)
    rules = [AxisRule((R,) * k, (R,))]
    for d in range(out.ndim - 1):
        rules.append(AxisRule((Shard(d),) * k, (Shard(d if d < dim else d + 1),)))
    if out.dtype.is_floating_point:
        rules.append(AxisRule((P,) * k, (P,)))
    return rules



def _write_rules(call: OpCall, src_dim: dict[int, int], overwrites_all: bool) -> list[AxisRule]:
    """`out = input` with `src` written into a region along one dim (the functional form of
    a slice or select assignment). A dim outside the region splits input, src and output
    alike (`src_dim`: input dim -> src dim); a write of sums is the sum of writes, so
    input and src partial together give a partial output. When the region is the whole
    input, the output is src itself and input's values do not matter: it may stay partial
    (or replicated) under a whole src (its shape must still match src's block, so a split
    src needs the input split alike)."""
    rules = [AxisRule((R, R), (R,))]
    rules += [AxisRule((Shard(i), Shard(s)), (Shard(i),)) for i, s in src_dim.items()]
    floating = call.outputs[0].dtype.is_floating_point
    if floating:
        rules.append(AxisRule((P, P), (P,)))
    if overwrites_all:
        whole = (R, P) if floating else (R,)
        rules += [AxisRule((ignored, p), (p,)) for ignored in whole for p in whole]
    return list(dict.fromkeys(rules))


@register(aten.slice_scatter.default)
def slice_scatter(call: OpCall) -> list[AxisRule]:
    inp, src = call.inputs
    dim = norm_dim(call.arg(2, "dim", 0), inp.ndim)
    overwrites_all = inp.shape == src.shape
    return _write_rules(call, {d: d for d in range(inp.ndim) if d != dim or overwrites_all}, overwrites_all)


@register(aten.select_scatter.default)
def select_scatter(call: OpCall) -> list[AxisRule]:
    inp = call.inputs[0]
    dim = norm_dim(call.args[2], inp.ndim)
    return _write_rules(call, {d: (d if d < dim else d - 1) for d in range(inp.ndim) if d != dim},
                        inp.shape[dim] == 1)
