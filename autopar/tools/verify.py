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
from autopar import api
from autopar.core.errors import InputMismatchError
from autopar.core.kinds import NodeKind
from autopar.core.placement import Partial, local_chunk
from autopar.passes.lower.emit import full_inputs, local_inputs
from autopar.passes.trace.trace import flatten_inputs, kv_cache_off
from autopar.runtime.module import ParallelModule
from autopar.runtime.outputs import is_split


@dataclass(frozen=True)
class Difference:
    """One tensor compared over all ranks: the largest |parallel - single device|, and the
    largest |parallel - single device| / (atol + rtol * |single device|), torch.testing's
    criterion (the tensor is within tolerance when that ratio is at most 1)."""

    name: str
    max_abs: float
    ratio: float

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0


@dataclass(frozen=True)
class VerifyReport:
    outputs: tuple[Difference, ...]  # per output leaf
    gradients: tuple[Difference, ...]  # per parameter the graph reads
    layers: tuple[Difference, ...]  # per intermediate value, topological order
    tolerance: tuple[float, float]  # (rtol, atol) the ratios were taken against
    ok: bool

    @property
    def first_mismatch(self) -> Optional[str]:
        for d in self.layers + self.outputs + self.gradients:
            if not d.ok:
                return d.name
        return None

    def __str__(self) -> str:
        rtol, atol = self.tolerance
        lines = [f"autopar.verify: {'OK' if self.ok else 'MISMATCH'} (rtol {rtol:g}, atol {atol:g})"]
        for title, rows in (("outputs", self.outputs), ("gradients", self.gradients), ("layers", self.layers)):
            if rows:
                worst = max(rows, key=lambda d: d.ratio)
                lines.append(f"  {title}: {len(rows)} compared, worst {worst.name} |diff| {worst.max_abs:.3e} "
                             f"({worst.ratio:.2f} of the tolerance)")
        if not self.ok:
            lines.append(f"  first mismatching tensor: {self.first_mismatch}")
        return "\n".join(lines)


def compare(name: str, got: Optional[torch.Tensor], want: torch.Tensor, rtol: float, atol: float) -> Difference:
    """This rank's difference, made the worst over all ranks (every rank must call it)."""
    if got is None or got.shape != want.shape:
        local = (float("inf"), float("inf"))
    elif not (got.is_floating_point() or want.is_floating_point()):
        local = (0.0, 0.0) if torch.equal(got, want) else (float("inf"), float("inf"))
    elif got.numel() == 0:
        local = (0.0, 0.0)
    else:
        diff = (got.detach().double() - want.detach().double()).abs()
        bound = atol + rtol * want.detach().double().abs()
        local = (diff.max().item(), (diff / bound).max().item())
    worst = torch.tensor(local, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return Difference(name, float(worst[0]), float(worst[1]))


def _float_leaves(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of an output, an output left split (a DTensor,
    Options.sharded_outputs) gathered whole, its gradient flowing back to the block."""
    leaves = [t for t in _compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return [t.full_tensor() if is_split(t) else t for t in leaves]


def _loss(leaves: list[torch.Tensor]) -> torch.Tensor:
    """Every output's mean square, in float32 or finer (a float64 check stays float64)."""
    return sum((t.to(torch.promote_types(t.dtype, torch.float32)) ** 2).mean() for t in leaves)


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "call_function":
            self.values[n.name] = out
        return out


def verify(model: nn.Module, args: tuple = (), kwargs: Optional[dict] = None, *, mesh: Any, plan: Any = None,
           layers: bool = False, rtol: float = 1.3e-6, atol: float = 1e-5, **option_overrides: Any) -> VerifyReport:
    """Compile `model` for `mesh` (or run `plan`), and compare with the single device:
    a tensor passes when |parallel - single| <= atol + rtol * |single| everywhere."""
    kwargs = dict(kwargs or {})
    reference = copy.deepcopy(model)
    with kv_cache_off(reference):  # as traced: a transformers model returns no KV cache
        ref_leaves = _float_leaves(reference(*args, **kwargs))
    if ref_leaves and any(t.requires_grad for t in ref_leaves):
        _loss(ref_leaves).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = api.compile(model, args, kwargs, mesh=mesh, plan=plan, **option_overrides)
    out_leaves = _float_leaves(pm(*args, **kwargs))
    if out_leaves and any(t.requires_grad for t in out_leaves):
        _loss(out_leaves).backward()
    if len(out_leaves) != len(ref_leaves):
        raise InputMismatchError(f"the parallel model returned {len(out_leaves)} floating-point outputs, the "
                                 f"single-device model {len(ref_leaves)}")
    outputs = tuple(compare(f"output[{i}]", a, b, rtol, atol) for i, (a, b) in enumerate(zip(out_leaves, ref_leaves)))
    grads = _compare_gradients(pm, reference, rtol, atol)
    layer_rows = _compare_layers(pm, args, kwargs, rtol, atol) if layers else ()
    ok = all(d.ok for d in outputs + grads + layer_rows)
    return VerifyReport(outputs, grads, layer_rows, (rtol, atol), ok)


def _compare_gradients(pm: ParallelModule, reference: nn.Module, rtol: float, atol: float) -> tuple[Difference, ...]:
    plan, traced = pm.current.plan, pm.current.traced
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    read = {e.producer for e in plan.edges}
    out = []
    for gi in traced.inputs:
        if gi.kind is not NodeKind.PARAMETER or gi.name not in read or ref_params[gi.target].grad is None:
            continue
        want = local_chunk(ref_params[gi.target].grad, plan.node(gi.name).outputs[0], plan.mesh.shape, pm.coords)
        out.append(compare(gi.target, pm.state_tensors[gi.target].grad, want, rtol, atol))
    return tuple(out)


def _compare_layers(pm: ParallelModule, args: tuple, kwargs: dict, rtol: float, atol: float) -> tuple[Difference, ...]:
    compiled = pm.current
    traced, plan, program = compiled.traced, compiled.plan, compiled.program
    tensors, _, _ = flatten_inputs(args, kwargs)
    state = dict(pm.source_model.named_parameters(remove_duplicate=False))
    state.update(pm.source_model.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        ref = _Recorder(traced.gm)
        ref.run(*full_inputs(traced.inputs, state, traced.constants, tensors))
        local = _Recorder(program.gm)
        local.run(*local_inputs(program, pm.state_tensors, traced.constants, tensors, plan.mesh.shape,
                                state_is_local=True))
    rows = []
    for n in plan.nodes:
        if n.name not in ref.values or n.name not in local.values or len(n.outputs) != 1:
            continue
        spec = n.outputs[0]
        if any(isinstance(p, Partial) for p in spec.placements) or not isinstance(ref.values[n.name], torch.Tensor):
            continue  # a partial sum is checked where it is reduced
        want = local_chunk(ref.values[n.name], spec, plan.mesh.shape, pm.coords)
        rows.append(compare(n.name, local.values[n.name], want, rtol, atol))
    return tuple(rows)
