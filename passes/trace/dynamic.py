"""Symbolic batch and sequence dims: export with torch.export `Dim`s, plan at hint sizes,
and decide at each call whether a planned program serves the call's sizes.

    inputs + Dynamic -> export_shapes -> torch.export(dynamic_shapes=...)   (one trace)
    traced graph     -> symbolic_dims: SymbolicDim(batch, s0, [1, 16], uses)
    plan             -> divisors: (s0*s1, 2) "this split needs s0*s1 % 2 == 0"
    a call's tensors -> DynamicSignature.refusal(tensors): None (reuse) or why not

1. Mark dim 0 of every tensor input as the batch and dim 1 of every two-dim integer or
   bool input as the sequence (autopar/core/dynamic.py), each one shared `Dim` with the
   Dynamic's range; the example inputs may be resized to the representative sizes first
   (Dynamic.plan_at), so every TensorMeta's int shape (a SymInt's hint) is that size and
   rules, costs and the ILP run unchanged.
2. A plan splits dims whose size is an expression of the symbols (s0, s0*s1); such a split
   is exact only where the expression divides by the ranks that split it. The divisors
   are read off the plan (every node's inputs and outputs, every reshard step's layout).
3. A call is served by a program when its inputs have the planned structure, dtypes and
   static sizes, agree on each symbol, every symbol lies in its range, and every divisor
   divides; otherwise refusal() says which dim and why (the runtime re-plans or raises).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from math import prod
from typing import Any, Optional

import sympy
import torch
from torch import fx

from autopar.core.dynamic import DimName, Dynamic
from autopar.core.errors import TraceError
from autopar.core.placement import Spec, size_hint
from autopar.core.plan import Plan

Use = tuple[int, int]  # (tensor leaf index, dim)


@dataclass(frozen=True)
class SymbolicDim:
    """One symbol of the trace: which input dims it sizes, its range and its hint."""

    name: DimName
    symbol: str  # torch.export's name for it, e.g. "s95"
    lo: int
    hi: int
    hint: int  # the size the plan was priced at
    uses: tuple[Use, ...]

    def __str__(self) -> str:
        return f"{self.name.value} ({self.symbol}) in [{self.lo}, {self.hi}], planned at {self.hint}"


@dataclass(frozen=True)
class Divisor:
    """`expr` (in the symbols) must divide evenly by `ways`: `where` is split that way."""

    expr: Any  # a sympy expression
    ways: int
    where: str


def marked_dims(tensors: list[torch.Tensor], dynamic: Dynamic) -> dict[Use, DimName]:
    """Step 1's rule: which (leaf, dim) is the batch and which the sequence. An input whose
    dim differs from the first input's (position ids of batch 1 broadcast over the batch)
    keeps it static: every marked dim shares one symbol. A size of 1 stays static too
    (torch.export specialises a dim traced at 1): such a call gets a plan of its own."""
    candidates: dict[Use, DimName] = {}
    for i, t in enumerate(tensors):
        if t.ndim >= 1 and dynamic.batch is not None:
            candidates[(i, 0)] = DimName.BATCH
        if t.ndim == 2 and dynamic.seq is not None and not t.is_floating_point() and not t.is_complex():
            candidates[(i, 1)] = DimName.SEQ
    first: dict[DimName, int] = {}
    for (leaf, d), name in candidates.items():
        first.setdefault(name, int(tensors[leaf].shape[d]))
    return {(leaf, d): name for (leaf, d), name in candidates.items()
            if tensors[leaf].shape[d] == first[name] and first[name] > 1}


def sizes_of(tensors: list[torch.Tensor], marked: dict[Use, DimName]) -> dict[DimName, int]:
    """The call's size of each marked dim (the first input that has it)."""
    sizes: dict[DimName, int] = {}
    for (leaf, dim), name in marked.items():
        sizes.setdefault(name, int(tensors[leaf].shape[dim]))
    return sizes


def export_shapes(tensors: list[torch.Tensor], marked: dict[Use, DimName],
                  ranges: dict[DimName, tuple[int, int]]) -> tuple:
    """torch.export's dynamic_shapes for a wrapper called as f(*tensors)."""
    dims = {name: torch.export.Dim(name.value, min=lo, max=hi) for name, (lo, hi) in ranges.items()}
    per_leaf = [{d: dims[name] for (leaf, d), name in marked.items() if leaf == i} or None
                for i in range(len(tensors))]
    return (tuple(per_leaf),)


def resized(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` with `size` entries along `dim`: its own entries repeated (token ids stay
    token ids), then cut."""
    if t.shape[dim] == size:
        return t
    reps = -(-size // max(1, t.shape[dim]))
    return torch.cat([t] * reps, dim=dim).narrow(dim, 0, size).contiguous()


def symbolic_dims(gm: fx.GraphModule, user_placeholders: list[str], range_constraints: dict) -> tuple[SymbolicDim, ...]:
    """Step 1's symbols as the exported program holds them: read from the user inputs'
    placeholders (leaf i is user_placeholders[i]); dim 0 is the batch, others the sequence."""
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    uses: dict[str, list[Use]] = {}
    found: dict[str, tuple[DimName, int, Any]] = {}
    for leaf, name in enumerate(user_placeholders):
        val = by_name[name].meta.get("val")
        for d, s in enumerate(getattr(val, "shape", ())):
            if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                key = str(s.node.expr)
                uses.setdefault(key, []).append((leaf, d))
                found.setdefault(key, (DimName.BATCH if d == 0 else DimName.SEQ, size_hint(s), s.node.expr))
    out = []
    for key, (name, hint, expr) in found.items():
        vr = next((v for k, v in range_constraints.items() if str(k) == key), None)
        lo = int(vr.lower) if vr is not None and vr.lower.is_finite else 0
        hi = int(vr.upper) if vr is not None and vr.upper.is_finite else 1 << 62
        out.append(SymbolicDim(name, key, lo, hi, hint, tuple(uses[key])))
    return tuple(out)


def specialised_error(model_name: str, dynamic_shapes: tuple, error: Exception) -> TraceError:
    """torch.export's constraint violation (the model fixes or bounds a dim marked
    symbolic) as a TraceError naming the dims, their ranges and torch's reason."""
    dims = {str(d.__name__): (d.min, d.max) for leaf in dynamic_shapes[0] if leaf for d in leaf.values()}
    text = str(error)
    named = [n for n in dims if f"({n}" in text or f" {n} " in text or f"{n}," in text] or list(dims)
    lines = [ln for ln in text.strip().splitlines() if ln.strip()][:8]
    return TraceError(
        f"model {model_name} specialises the symbolic dim(s) {', '.join(named)} "
        f"({'; '.join(f'{n} in [{dims[n][0]}, {dims[n][1]}]' for n in named)}): torch.export says\n"
        + "\n".join(lines) + "\nKeep that dim static (Dynamic(batch=None) or Dynamic(seq=None)), narrow its range "
        "to what the model accepts, or compile with dynamic=False.")


def is_symbolic(value: Any) -> bool:
    """True for a tensor with a symbolic size, or a symbolic int."""
    if isinstance(value, torch.SymInt):
        return not value.node.expr.is_number
    if isinstance(value, torch.Tensor):
        return any(is_symbolic(s) for s in value.shape)
    return False


def divisors(gm: fx.GraphModule, plan: Plan) -> tuple[Divisor, ...]:
    """Step 2: every (symbolic size, ranks splitting it) the plan relies on."""
    vals = {n.name: n.meta.get("val") for n in gm.graph.nodes}
    producers = {n.name: [a.name for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
                 for n in gm.graph.nodes}
    found: dict[tuple, Divisor] = {}

    def add(value: Any, spec: Optional[Spec], where: str) -> None:
        if spec is None or not isinstance(value, torch.Tensor):
            return
        for d, s in enumerate(value.shape):
            ways = prod(plan.mesh.shape[a] for a in spec.shard_axes(d))
            if ways > 1 and is_symbolic(s):
                expr = s.node.expr
                found.setdefault((str(expr), ways), Divisor(expr, ways, f"{where} dim {d}"))

    for choice in plan.nodes:
        for k, spec in enumerate(choice.outputs):
            val = vals.get(choice.name)
            add(val[k] if isinstance(val, (tuple, list)) else val, spec, choice.name)
        for name, spec in zip(producers.get(choice.name, ()), choice.inputs):
            add(vals.get(name), spec, f"input of {choice.name}")
    for edge in plan.edges:
        for step in edge.steps:
            val = vals.get(edge.producer)
            add(val[edge.index] if isinstance(val, (tuple, list)) else val, step.before, f"{edge.producer} (reshard)")
    return tuple(found.values())


@dataclass(frozen=True)
class DynamicSignature:
    """What a call must match to reuse one dynamic program (step 3)."""

    structure: tuple  # (pytree spec, non-tensor leaves)
    tensors: tuple[tuple[tuple[Optional[int], ...], torch.dtype], ...]  # static sizes, None where symbolic
    symbols: tuple[SymbolicDim, ...]
    divisors: tuple[Divisor, ...]

    @staticmethod
    def of(structure: tuple, tensors: list[torch.Tensor], symbols: tuple[SymbolicDim, ...],
           divs: tuple[Divisor, ...]) -> "DynamicSignature":
        symbolic = {u for s in symbols for u in s.uses}
        shapes = tuple((tuple(None if (i, d) in symbolic else int(n) for d, n in enumerate(t.shape)), t.dtype)
                       for i, t in enumerate(tensors))
        return DynamicSignature(structure, shapes, symbols, divs)

    def refusal(self, structure: tuple, tensors: list[torch.Tensor], paths: tuple[str, ...] = ()
                ) -> Optional["Refusal"]:
        """None when this program serves the call; else why not, naming the dim and the limit."""
        if structure != self.structure or len(tensors) != len(self.tensors):
            return Refusal(RefusalKind.OTHER_SIGNATURE, "")
        for t, (shape, dtype) in zip(tensors, self.tensors):
            static_differs = any(n is not None and n != m for n, m in zip(shape, t.shape))
            if t.dtype != dtype or t.ndim != len(shape) or static_differs:
                return Refusal(RefusalKind.OTHER_SIGNATURE, "")
        by_name: dict[str, int] = {}
        for s in self.symbols:
            sizes = {int(tensors[leaf].shape[d]) for leaf, d in s.uses}
            if len(sizes) > 1:  # inputs disagree on a size the trace shares: another signature
                return Refusal(RefusalKind.OTHER_SIGNATURE, "")
            by_name[s.symbol] = size = sizes.pop()
            if not s.lo <= size <= s.hi:
                leaf, d = s.uses[0]
                where = paths[leaf] if leaf < len(paths) else f"input #{leaf}"
                return Refusal(RefusalKind.OUT_OF_RANGE, f"the {s.name.value} size (dim {d} of {where}) is {size}, "
                               f"outside the planned range [{s.lo}, {s.hi}]")
        for div in self.divisors:
            n = int(div.expr.xreplace({sym: by_name[str(sym)] for sym in div.expr.free_symbols}))
            if n % div.ways or n < div.ways:
                sizes = ", ".join(f"{s.name.value}={by_name[s.symbol]}" for s in self.symbols)
                return Refusal(RefusalKind.INDIVISIBLE, f"the plan splits {div.where} (size {div.expr} = {n} at "
                               f"{sizes}) {div.ways} ways, which does not divide it")
        return None


class RefusalKind(Enum):
    OTHER_SIGNATURE = "other signature"  # structure, dtype or a static size differs: no warning
    OUT_OF_RANGE = "out of range"  # a symbolic size outside its range
    INDIVISIBLE = "indivisible"  # in range, but a split the plan relies on does not divide


@dataclass(frozen=True)
class Refusal:
    """Why a program does not serve a call: the kind decides warn, re-plan or raise."""

    kind: RefusalKind
    reason: str  # names the dim and the size, and the range or the split
