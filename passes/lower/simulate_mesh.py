"""Run every rank's program of a plan in one process, in lockstep, for fast tests.

The programs of all ranks have the same nodes; only slice offsets and process groups
differ. This runs them node by node: ordinary ops once per rank, and each reshard step
as ONE autograd function over all ranks' tensors whose forward and backward apply the
same per-axis moves (and the same conjugates) as autopar/collectives.py does over a
process group. Backward from every rank's outputs then reproduces what each rank's
real backward computes. This is a simulated fast path beside real gloo ranks, never
instead of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from autopar.passes.lower.emit import buffer_blocks, emit, local_inputs
from autopar.core.causal import attend_halves, halves
from autopar.core.routed import run_sorted
from autopar.passes.lower.program import CausalRowsModule, ExpertsModule, StepModule, WaitModule
from autopar.passes.lower.recompute import Recomputed, checkpoint
from autopar.core.mesh import Mesh
from autopar.core.placement import split_blocks
from autopar.core.resharding import Step


def _groups(mesh: Mesh, axis: int) -> list[tuple[int, ...]]:
    seen, out = set(), []
    for r in range(mesh.size):
        g = mesh.axis_ranks(r, axis)
        if g not in seen:
            seen.add(g)
            out.append(g)
    return out


def _apply(kind: str, step: Step, xs: list[torch.Tensor], mesh: Mesh) -> list[torch.Tensor]:
    """One move on `step.axis` for all ranks at once (`kind` may be the step's backward)."""
    out: list[Any] = [None] * len(xs)
    n = mesh.shape[step.axis]
    for group in _groups(mesh, step.axis):
        vals = [xs[r] for r in group]
        if kind in ("identity", "grad_sync_fwd"):
            res = vals
        elif kind == "all_reduce" or kind == "grad_sync":
            red = step.reduce if kind == "all_reduce" else "sum"
            total = torch.stack(vals).sum(0) if red != "max" else torch.stack(vals).amax(0)
            res = [total / n if red == "avg" else total] * n
        elif kind == "all_gather":
            res = [torch.cat(vals, dim=step.dim)] * n
        elif kind in ("slice", "slice_back"):
            res = [split_blocks(v, n, step.dim, step.dim_unit)[i] for i, v in enumerate(vals)]
        elif kind == "reduce_scatter":
            total = torch.stack(vals).sum(0)
            res = list(split_blocks(total, n, step.dim, step.dim_unit))
        elif kind == "all_to_all":
            res = [torch.cat([split_blocks(v, n, step.to_dim, step.unit)[i] for v in vals], dim=step.dim)
                   for i in range(n)]
        elif kind == "all_to_all_back":
            res = [torch.cat([split_blocks(v, n, step.dim, step.dim_unit)[i] for v in vals], dim=step.to_dim)
                   for i in range(n)]
        elif kind == "to_partial":
            res = [v if i == 0 else torch.zeros_like(v) for i, v in enumerate(vals)]
        else:
            raise ValueError(f"simulator has no move {kind!r}")
        for r, v in zip(group, res):
            out[r] = v.clone()
    return out


_FORWARD = {"grad_sync": "grad_sync_fwd"}
_BACKWARD = {"identity": "identity", "slice": "slice_back", "all_gather": "all_gather",
             "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all_back", "all_reduce": "all_reduce"}


class _MeshStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: Step, mesh: Mesh, *xs):
        ctx.step, ctx.mesh = step, mesh
        if step.kind == "all_reduce" and step.reduce == "max":
            raise NotImplementedError("the lockstep simulator does not model P(max) reductions")
        return tuple(_apply(_FORWARD.get(step.kind, step.kind), step, list(xs), mesh))

    @staticmethod
    def backward(ctx, *gs):
        step = ctx.step
        kind = _BACKWARD[step.backward]
        if step.kind == "all_reduce" and step.reduce == "avg":
            return (None, None) + tuple(g / ctx.mesh.shape[step.axis] for g in gs)
        return (None, None) + tuple(_apply(kind, step, list(gs), ctx.mesh))


def run_lockstep(programs: list[fx.GraphModule], mesh: Mesh, inputs: list[list[torch.Tensor]]) -> list[Any]:
    """Outputs of every rank: programs[r] fed inputs[r] (placeholder order)."""
    graphs = [p.graph for p in programs]
    envs: list[dict[str, Any]] = [dict() for _ in programs]
    for r, g in enumerate(graphs):
        for node, value in zip([n for n in g.nodes if n.op == "placeholder"], inputs[r]):
            envs[r][node.name] = value
    node_lists = [list(g.nodes) for g in graphs]
    outputs: list[Any] = [None] * len(programs)
    for i, node in enumerate(node_lists[0]):
        if node.op == "placeholder":
            continue
        if node.op == "call_module" and isinstance(programs[0].get_submodule(node.target), ExpertsModule):
            calls = [fx.node.map_arg((node_lists[r][i].args, node_lists[r][i].kwargs), lambda a: envs[r][a.name])
                     for r in range(len(programs))]
            ys = _experts(programs[0].get_submodule(node.target).axis, mesh, [args for args, _ in calls])
            for r in range(len(programs)):
                envs[r][node_lists[r][i].name] = ys[r]
            continue
        if node.op == "call_module" and isinstance(programs[0].get_submodule(node.target), CausalRowsModule):
            calls = [fx.node.map_arg((node_lists[r][i].args, node_lists[r][i].kwargs), lambda a: envs[r][a.name])
                     for r in range(len(programs))]
            ys = _causal_rows(programs[0].get_submodule(node.target), mesh, calls)
            for r in range(len(programs)):
                envs[r][node_lists[r][i].name] = ys[r]
            continue
        if node.op == "call_module":
            mod = programs[0].get_submodule(node.target)
            xs = [envs[r][node_lists[r][i].args[0].name] for r in range(len(programs))]
            if isinstance(mod, Recomputed):  # every rank's block under one checkpoint
                ys = _recomputed([p.get_submodule(node.target).body for p in programs], mesh,
                                 [[envs[r][a.name] for a in node_lists[r][i].args] for r in range(len(programs))])
            elif isinstance(mod, WaitModule):  # the step ran whole at its start
                ys = xs
            elif isinstance(mod, StepModule):
                ys = _MeshStep.apply(mod.step, mesh, *xs)
            else:
                raise TypeError(f"rank program module {node.target} is a {type(mod).__name__}, not a reshard step")
            for r in range(len(programs)):
                envs[r][node_lists[r][i].name] = ys[r]
            continue
        for r in range(len(programs)):
            n = node_lists[r][i]
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: envs[r][a.name])
            if n.op == "output":
                outputs[r] = args[0]
            else:
                envs[r][n.name] = n.target(*args, **kwargs)
    return outputs


def _experts(axis: int, mesh: Mesh, calls: list[tuple]) -> list[torch.Tensor]:
    """Routed experts split with their rows over `axis`, for all ranks at once: each
    group's rows and experts put together, computed, and each rank's rows handed back."""
    out: list[Any] = [None] * len(calls)
    for group in _groups(mesh, axis):
        ids, rows, experts, row_group, num_experts, body = calls[group[0]]
        ids = torch.cat([calls[r][0] for r in group])
        rows = [torch.cat([calls[r][1][j] for r in group]) for j in range(len(rows))]
        experts = [torch.cat([calls[r][2][j] for r in group]) for j in range(len(experts))]
        y = run_sorted(ids, rows, experts, row_group, num_experts, body)
        for r, block in zip(group, y.split([calls[r][0].shape[0] for r in group])):
            out[r] = block
    return out


def _causal_rows(mod: CausalRowsModule, mesh: Mesh, calls: list[tuple]) -> list[torch.Tensor]:
    """Balanced causal rows (autopar/core/causal.py) of every rank at once: each group's
    ranks keep their first halves and compute their mirrors' second halves."""
    out: list[Any] = [None] * len(calls)
    for group in _groups(mesh, mod.axis):
        ways = len(group)
        pieces = [halves(calls[r][0][0], calls[r][0][1].shape[-2], ways, mod.unit, c) for c, r in enumerate(group)]
        done = []
        for c, r in enumerate(group):
            args, kwargs = calls[r]
            dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            done.append(attend_halves(pieces[c][0], pieces[ways - 1 - c][1], args[1], args[2], c, ways, mod.unit,
                                      dropout_p, kwargs.get("scale"), kwargs.get("enable_gqa", False)))
        for c, r in enumerate(group):
            out[r] = torch.cat([done[c][0], done[ways - 1 - c][1]], dim=-2)
    return out


def _recomputed(bodies: list[fx.GraphModule], mesh: Mesh, args: list[list[Any]]) -> list[Any]:
    """A recomputed block (passes/lower/recompute.py) of every rank, run in lockstep under one
    non-reentrant checkpoint, as each rank's Recomputed runs its own."""
    width = len(args[0])

    def body(*flat: Any) -> tuple:
        outs = run_lockstep(bodies, mesh, [list(flat[r * width:(r + 1) * width]) for r in range(len(bodies))])
        return tuple(y for out in outs for y in out)

    flat = checkpoint(body, *[a for per_rank in args for a in per_rank], use_reentrant=False)
    n = len(flat) // len(bodies)
    return [tuple(flat[r * n:(r + 1) * n]) for r in range(len(bodies))]


def simulate(traced, plan, state: dict[str, torch.Tensor], user_tensors: list[torch.Tensor],
             constants: dict | None = None) -> tuple[list[Any], list[dict[str, torch.Tensor]],
                                                     list[dict[str, torch.Tensor]]]:
    """Every rank's output leaves (the model's own, as its out_spec flattens them), every
    rank's local parameter leaves (requires_grad set like the full ones, so a backward
    from the outputs fills their .grad), and every rank's new block of each buffer the
    program writes (what the runtime stores after the call; passes/emit.buffer_blocks)."""
    mesh = plan.mesh
    programs, inputs, leaves, emitted = [], [], [], []
    detached = {name: t.detach() for name, t in state.items()}
    for r in range(mesh.size):
        prog = emit(traced, plan, mesh.coords(r))
        programs.append(prog.gm)
        emitted.append(prog)
        local = local_inputs(prog, detached, constants or traced.constants, user_tensors, mesh.shape,
                             state_is_local=False)
        mine = {}
        for gi, t in zip(prog.inputs, local):
            if gi.kind.is_state:
                mine[gi.target] = t.requires_grad_(state[gi.target].requires_grad)
        inputs.append(local)
        leaves.append(mine)
    outs = run_lockstep(programs, mesh, inputs)
    buffers = [buffer_blocks(prog, traced, plan, o, mesh.shape) for prog, o in zip(emitted, outs)]
    return [traced.user_outputs(o) for o in outs], leaves, buffers
