"""autopar.verify: check a plan on your own model and inputs.

Compiles the model on the live process group, runs forward and backward on the mesh
and on the single device (every rank computes the reference itself), and reports the
largest difference of every output and every parameter gradient over all ranks. With
layers=True it also compares every intermediate value the plan keeps unreduced and names
the first node where the two runs part.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import fx, nn

from autopar import _compat
from autopar.core.placement import Partial, local_chunk


@dataclass(frozen=True)
class VerifyReport:
    outputs: tuple[tuple[str, float], ...]  # (output index, max abs error over ranks)
    gradients: tuple[tuple[str, float], ...]  # (parameter, max abs error over ranks)
    layers: tuple[tuple[str, float], ...]  # (node, max abs error), topological order
    tolerance: tuple[float, float]  # (rtol, atol) used for `ok`
    ok: bool

    @property
    def first_mismatch(self) -> Optional[str]:
        rtol, atol = self.tolerance
        for name, err in self.layers + self.outputs + self.gradients:
            if err > atol:
                return name
        return None

    def __str__(self) -> str:
        lines = [f"autopar.verify: {'OK' if self.ok else 'MISMATCH'} (atol {self.tolerance[1]:g})"]
        for title, rows in (("outputs", self.outputs), ("gradients", self.gradients), ("layers", self.layers)):
            if rows:
                worst = max(rows, key=lambda r: r[1])
                lines.append(f"  {title}: {len(rows)} compared, worst {worst[0]} {worst[1]:.3e}")
        if not self.ok:
            lines.append(f"  first mismatching tensor: {self.first_mismatch}")
        return "\n".join(lines)


def _float_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in _compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _loss(leaves: list[torch.Tensor]) -> torch.Tensor:
    return sum((t.float() ** 2).mean() for t in leaves)


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "call_function":
            self.values[n.name] = out
        return out


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def verify(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *, mesh: Any, plan: Any = None,
           layers: bool = False, rtol: float = 1.3e-6, atol: float = 1e-5, **option_overrides: Any) -> VerifyReport:
    """Compile `model` for `mesh` (or run `plan`), and compare with the single device."""
    from autopar.api import compile as compile_
    kwargs = dict(kwargs or {})
    reference = copy.deepcopy(model)
    ref_out = reference(*args, **kwargs)
    ref_leaves = _float_leaves(ref_out)
    if ref_leaves and any(t.requires_grad for t in ref_leaves):
        _loss(ref_leaves).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = compile_(model, args, kwargs, mesh=mesh, plan=plan, **option_overrides)
    out_leaves = _float_leaves(pm(*args, **kwargs))
    if out_leaves and any(t.requires_grad for t in out_leaves):
        _loss(out_leaves).backward()
    outputs = tuple((f"output[{i}]", _max_over_ranks((a.detach() - b.detach()).abs().max().item()))
                    for i, (a, b) in enumerate(zip(out_leaves, ref_leaves)))
    compiled = pm._last
    plan_ = compiled.plan
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    grads = []
    used = {e.producer for e in plan_.edges}
    for gi in compiled.traced.inputs:
        if gi.kind != "parameter" or gi.name not in used or ref_params[gi.target].grad is None:
            continue
        spec = plan_.node(gi.name).outputs[0]
        want = local_chunk(ref_params[gi.target].grad, spec, plan_.mesh.shape, pm.coords)
        got = pm.shards.get_parameter(gi.target).grad
        err = float("inf") if got is None else (got - want).abs().max().item()
        grads.append((gi.target, _max_over_ranks(err)))
    layer_rows = _compare_layers(pm, compiled, args, kwargs) if layers else ()
    ok = all(e <= atol for _, e in outputs + tuple(grads) + tuple(layer_rows))
    return VerifyReport(outputs, tuple(grads), tuple(layer_rows), (rtol, atol), ok)


def _compare_layers(pm, compiled, args: tuple, kwargs: dict) -> tuple[tuple[str, float], ...]:
    from autopar.passes.trace import flatten_inputs
    traced, plan, program = compiled.traced, compiled.plan, compiled.program
    tensors, _, _ = flatten_inputs(args, kwargs)
    state = dict(pm._model.named_parameters(remove_duplicate=False))
    state.update(pm._model.named_buffers(remove_duplicate=False))
    full_inputs = [state[gi.target] if gi.kind in ("parameter", "buffer") else
                   traced.constants[gi.target] if gi.kind == "constant" else tensors[gi.target]
                   for gi in traced.inputs]
    with torch.no_grad():
        ref = _Recorder(traced.gm)
        ref.run(*full_inputs)
        local = _Recorder(program.gm)
        local.run(*pm._local_inputs(compiled, tensors))
    rows = []
    for n in plan.nodes:
        if n.name not in ref.values or n.name not in local.values or len(n.outputs) != 1:
            continue
        spec = n.outputs[0]
        if any(isinstance(p, Partial) for p in spec.placements) or not isinstance(ref.values[n.name], torch.Tensor):
            continue  # a partial sum is checked where it is reduced
        want = local_chunk(ref.values[n.name], spec, plan.mesh.shape, pm.coords)
        got = local.values[n.name]
        if got.shape != want.shape:
            err = float("inf")
        elif got.is_floating_point():
            err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        else:
            err = 0.0 if torch.equal(got, want) else float("inf")
        rows.append((n.name, _max_over_ranks(err)))
    return tuple(rows)
