"""The plans of a model planned with Options.dynamic: one per range of sizes, and which
of them serves a call (a ParallelModule keeps one DynamicPlans per mode, its entries its
compiled programs; autopar.plan makes the first plan offline the same way).

    call -> flatten -> first program whose DynamicSignature serves it -> run (no trace, no solve)
                    \\-> none: why (out of range / indivisible) -> warn once (or raise) ->
                        ranges and representative sizes -> trace (Dims) -> plan -> program

1. A call is matched against the programs planned so far (passes/trace/dynamic.py
   DynamicSignature.refusal): same structure, dtypes and static sizes, every symbolic
   size in its range, every split the plan relies on dividing.
2. No match because of a range or a divisibility: with OutOfRange.RAISE a size outside
   the range is an InputMismatchError naming the dim, the size and the range; otherwise
   one warning (DynamicReplanWarning) says why, and the call re-plans.
3. Planning: ranges are the Dynamic's (widened to hold the call's sizes when it re-plans
   for one outside them); the inputs are resized to the representative sizes
   (Dynamic.plan_at, else the call's own; a size of 1 stays static, as torch.export
   would fix it), and `compile_fn` traces with those Dims and plans.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from math import prod
from typing import Any, Callable, Optional, Protocol

import torch

from autopar import _compat
from autopar.core.dynamic import DimName, Dynamic, OutOfRange
from autopar.core.errors import InputMismatchError, OptionsError
from autopar.core.plan import Plan
from autopar.passes.trace.dynamic import (DynamicSignature, RefusalKind, SymbolicDim, divisors, export_shapes, marked_dims,
                                    resized, sizes_of)
from autopar.passes.trace.trace import TracedGraph, flatten_inputs


class DynamicReplanWarning(UserWarning):
    """A call's sizes are outside every dynamic plan's range, or a split does not divide them."""


@dataclass(frozen=True)
class PlannedSignature:
    """One entry of pm.plans: the inputs a plan serves ("batch"/"seq" where symbolic)."""

    inputs: tuple[tuple[str, tuple, torch.dtype], ...]  # (path, sizes, dtype) per tensor input
    symbols: tuple[SymbolicDim, ...] = ()

    def __str__(self) -> str:
        names = {s.symbol: s.name.value for s in self.symbols}
        text = ", ".join(f"{p} [{', '.join(names.get(str(n), str(n)) for n in shape)}] "
                         f"{str(dtype).removeprefix('torch.')}" for p, shape, dtype in self.inputs)
        return text + "".join(f"; {s}" for s in self.symbols)


class Planned(Protocol):
    """What compile_fn returns: a traced graph and its plan (a ParallelModule's Compiled,
    which adds the program, or autopar.plan's offline pair)."""

    traced: TracedGraph
    plan: Plan


@dataclass(frozen=True)
class PlannedGraph:
    """A Planned made offline: the trace and plan, no program."""

    traced: TracedGraph
    plan: Plan


class DynamicPlans:
    """Steps 1-3; `compile_fn(args, kwargs, dynamic_shapes)` traces and plans (on ranks,
    every rank takes part) and returns a Planned."""

    def __init__(self, dynamic: Dynamic, compile_fn: Callable[[tuple, dict, tuple], Planned]) -> None:
        self.dynamic = dynamic
        self.compile_fn = compile_fn
        self.entries: list[tuple[DynamicSignature, Any, PlannedSignature]] = []

    def compiled(self, args: tuple, kwargs: dict) -> Any:
        tensors, spec, consts = flatten_inputs(args, kwargs)
        structure = (str(spec), repr(consts))
        paths = _compat.tensor_leaf_paths((tuple(args), dict(kwargs)))
        # 1. match
        refusals = []
        for signature, compiled, _ in self.entries:
            refusal = signature.refusal(structure, tensors, paths)
            if refusal is None:
                return compiled
            if refusal.kind is not RefusalKind.OTHER_SIGNATURE:
                refusals.append(refusal)
        # 2. why not
        marked = marked_dims(tensors, self.dynamic)
        sizes = sizes_of(tensors, marked)
        outside = self._outside(sizes, paths, marked)
        if refusals or outside:
            why = refusals[0].reason if refusals else "their sizes are outside the Dynamic's ranges"
            warnings.warn(DynamicReplanWarning(
                f"autopar: {'re-' if self.entries else ''}planning (trace and solve) for these inputs: {why}"
                + (f"; the new plan's range is {outside}" if outside else "")), stacklevel=4)
        # 3. plan
        ranges = self._ranges(sizes)
        args2, kwargs2 = self._representative(args, kwargs, marked, sizes, ranges)
        compiled = self.compile_fn(args2, kwargs2, export_shapes(tensors, marked, ranges))
        symbols = compiled.traced.symbolic
        signature = DynamicSignature.of(structure, tensors, symbols, divisors(compiled.traced.gm, compiled.plan))
        symbolic = {u: s.symbol for s in symbols for u in s.uses}
        planned = PlannedSignature(tuple((p, tuple(symbolic.get((i, d), n) for d, n in enumerate(t.shape)), t.dtype)
                                         for i, (p, t) in enumerate(zip(paths, tensors))), symbols)
        self.entries.append((signature, compiled, planned))
        refusal = signature.refusal(structure, tensors, paths)
        if refusal is not None and self.dynamic.plan_at is not None:  # priced at other sizes, split otherwise
            compiled = self._at_call_sizes(args, kwargs, refusal.reason)
        elif refusal is not None:
            raise RuntimeError(f"autopar bug: a plan priced at this call's own sizes does not serve it: "
                               f"{refusal.reason}")
        return compiled

    def _at_call_sizes(self, args: tuple, kwargs: dict, reason: str) -> Any:
        """The first plan of a range does not serve its own call (Dynamic.plan_at priced
        other sizes): plan once more at the call's sizes."""
        warnings.warn(DynamicReplanWarning(f"autopar: the plan made at Dynamic.plan_at does not serve this call "
                                           f"({reason}); planning again at the call's sizes"), stacklevel=5)
        before, self.dynamic = self.dynamic, Dynamic(self.dynamic.batch, self.dynamic.seq, None,
                                                    self.dynamic.out_of_range)
        try:
            with warnings.catch_warnings():  # this call's one warning is above
                warnings.simplefilter("ignore", DynamicReplanWarning)
                return self.compiled(args, kwargs)
        finally:
            self.dynamic = before

    def for_local(self, tensors: list[torch.Tensor], structure: tuple, mesh_shape: tuple[int, ...],
                  user_specs: Callable[[Any], list]) -> Optional[Any]:
        """The program that takes these blocks of the inputs (pm(..., local_inputs=True)):
        each block's global shape is its local shape times the ranks splitting each dim
        (its input's spec in that program), which must be a call the program serves."""
        for signature, compiled, _ in self.entries:
            specs = user_specs(compiled)
            if len(specs) != len(tensors):
                continue
            whole = [torch.empty([n * prod(mesh_shape[a] for a in spec.shard_axes(d)) for d, n in enumerate(t.shape)],
                                 dtype=t.dtype, device="meta") for t, spec in zip(tensors, specs)]
            if signature.refusal(structure, whole) is None:
                return compiled
        return None

    @property
    def plans(self) -> list[PlannedSignature]:
        return [planned for _, _, planned in self.entries]

    def compiled_programs(self) -> list[Any]:
        """Each range's program, in the order they were planned."""
        return [compiled for _, compiled, _ in self.entries]

    def _outside(self, sizes: dict[DimName, int], paths: tuple[str, ...], marked: dict) -> str:
        """'' when every size is in the Dynamic's range; else (RAISE) an error or (REPLAN) the
        widened ranges, described."""
        out = []
        for name, size in sizes.items():
            lo, hi = self.dynamic.range_of(name)
            if lo <= size <= hi:
                continue
            if self.dynamic.out_of_range is OutOfRange.RAISE:
                leaf, d = next(u for u, n in marked.items() if n is name)
                limit = f"the largest planned is {hi}" if size > hi else f"the smallest planned is {lo}"
                raise InputMismatchError(
                    f"input {paths[leaf]} has {name.value} size {size} (its dim {d}) but the module was planned for "
                    f"{name.value} sizes in [{lo}, {hi}] ({limit}); widen Dynamic({name.value}=(lo, hi)) or use "
                    "Dynamic(out_of_range=OutOfRange.REPLAN) to plan again for it")
            out.append(f"{name.value} in [{min(lo, size)}, {max(hi, size)}]")
        return ", ".join(out)

    def _ranges(self, sizes: dict[DimName, int]) -> dict[DimName, tuple[int, int]]:
        ranges = {}
        for name, size in sizes.items():
            lo, hi = self.dynamic.range_of(name)
            ranges[name] = (min(lo, size), max(hi, size))
        return ranges

    def _representative(self, args: tuple, kwargs: dict, marked: dict, sizes: dict[DimName, int],
                        ranges: dict[DimName, tuple[int, int]]) -> tuple[tuple, dict]:
        """The inputs resized to the sizes the plan is priced at."""
        target = {}
        for name, size in sizes.items():
            chosen = self.dynamic.representative(name) or size
            lo, hi = ranges[name]
            if not lo <= chosen <= hi or chosen < 2:
                raise OptionsError(f"Dynamic.plan_at gives {name.value} size {chosen}, outside its range [{lo}, {hi}] "
                                   "or below 2 (torch.export fixes a dim traced at size 1); choose a size in range")
            target[name] = chosen
        leaves, tree = _compat.tree_flatten((tuple(args), dict(kwargs)))
        index = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        for (leaf, d), name in marked.items():
            leaves[index[leaf]] = resized(leaves[index[leaf]], d, target[name])
        return _compat.tree_unflatten(leaves, tree)
