"""Buffers whose updates stay on their own rank: a KV cache that the plan splits.

    before:  output node asks every returned value replicated
             key_cache (S(1)) -> index_copy (S(1)) -> all_gather -> output (R)  -> each rank slices its block
    after:   key_cache (S(1)) -> index_copy (S(1)) -> output (S(1))             -> each rank keeps its block

The output node of a plan asks every returned value whole (passes/strategies/strategies.py, step 4),
so a split buffer's new value is gathered whole and then cut again (passes/lower/emit.py,
buffer_blocks): for a KV cache that is the whole cache moved at every step, and the
solver, pricing it, never splits the cache. When a buffer's layout is fixed before the
solve (pinned), its update can be asked in that same layout instead, and each rank keeps
its block without communication.

1. local_buffer_updates: the output node asks each named buffer's update in the layout
   of the buffer's placeholder, where that layout is pinned (one choice).
2. candidate_layouts: the layouts worth trying for a buffer split along some of its dims
   (every R/S(d) combination over the mesh axes that divides evenly): the caller solves
   once per candidate, pinned, and keeps the plan the cost model prices lowest, so the
   solver's objective decides the cache's layout while the update stays local.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from typing import Callable, Collection, Iterable, Optional

from autopar.core.errors import MemoryBudgetError, MeshError, SolverError
from autopar.core.kinds import NodeKind
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.placement import Placement, R, Shard, Spec, TensorMeta
from autopar.core.plan import Plan
from autopar.passes.rules import Strategy
from autopar.passes.strategies.strategies import AnnotatedGraph, annotate
from autopar.passes.trace.trace import TracedGraph

# what runs one solve of an annotated graph (the runtime may measure its ops first)
SolveGraph = Callable[[AnnotatedGraph], Plan]


@dataclass(frozen=True)
class LocalBuffers:
    """Buffers whose updates each rank keeps locally, and the dims their layout may split
    (a KV cache: (batch, kv_heads, length, head_dim) may split dims 0 and 1)."""

    names: tuple[str, ...]  # state-dict names
    split_dims: tuple[int, ...]
    layout: Optional[tuple[Placement, ...]] = None  # the user's choice instead of the solver's

    def __post_init__(self) -> None:
        odd = [str(p) for p in self.layout or () if p != R and not (isinstance(p, Shard) and p.dim in self.split_dims)]
        if odd:
            raise MeshError(f"layout {''.join(map(str, self.layout or ()))!r} for {self.names[0]} and the other "
                            f"{len(self.names) - 1} buffers uses {', '.join(odd)}; they may be split only along "
                            f"dims {self.split_dims} (a KV cache: S(0) batch, S(1) KV heads) or replicated (R)")


def local_buffer_updates(graph: AnnotatedGraph, names: Collection[str]) -> AnnotatedGraph:
    """Step 1: `graph` with its output node asking each update of a buffer in `names`
    in the buffer's own (pinned) layout; buffers with a free layout are left replicated."""
    output = next((n for n in graph.nodes if n.kind is NodeKind.OUTPUT), None)
    if output is None or len(output.strategies) != 1:
        return graph
    specs = list(output.strategies[0].inputs)
    for update in graph.traced.buffer_updates:
        holder = graph.by_name.get(update.placeholder)
        if update.target not in names or holder is None or len(holder.strategies) != 1:
            continue
        specs[update.index] = holder.strategies[0].outputs[0]
    new = replace(output, strategies=(Strategy(tuple(specs), ()),))
    nodes = tuple(new if n is output else n for n in graph.nodes)
    return replace(graph, nodes=nodes, by_name={**graph.by_name, new.name: new})


def candidate_layouts(meta: TensorMeta, mesh: Mesh, dims: Iterable[int]) -> list[tuple[Placement, ...]]:
    """Step 2: every layout of a tensor of `meta` that splits only `dims`, one placement
    per mesh axis, that divides evenly; replicated first."""
    split: list[Placement] = [R] + [Shard(d) for d in dims if meta.shape[d] > 1]
    per_axis = [split if n > 1 else [R] for n in mesh.shape]
    found = [tuple(c) for c in product(*per_axis)]
    fits = [c for c in found if Spec(c, meta).fits(mesh.shape)]
    return sorted(fits, key=lambda c: sum(p != R for p in c))


def plan_local_buffers(traced: TracedGraph, mesh: Mesh, options: Options, pinned: Optional[dict],
                       local: LocalBuffers, solve_graph: SolveGraph) -> Plan:
    """Step 3: the cheapest plan over the candidate layouts of `local`'s buffers (one
    layout shared by all of them: every layer's cache is split alike), each solved with
    its buffers pinned and their updates kept local. Buffers already pinned keep theirs."""
    pinned = dict(pinned or {})
    metas = {gi.target: gi.meta for gi in traced.inputs if gi.target in local.names}
    free = [name for name in local.names if name in metas and name not in pinned]
    choices: list[Optional[tuple[Placement, ...]]] = [None]
    if free:
        choices = [local.layout] if local.layout is not None else list(
            candidate_layouts(metas[free[0]], mesh, local.split_dims))
    best: Optional[Plan] = None
    over: list[MemoryBudgetError] = []  # candidates no plan of which fits the budget
    for choice in choices:
        trial = dict(pinned)
        if choice is not None:
            trial.update({n: choice for n in free if Spec(choice, metas[n]).fits(mesh.shape)})
        graph = local_buffer_updates(annotate(traced, mesh, trial, options.discover_rules), set(local.names))
        try:
            plan = solve_graph(graph)
        except MemoryBudgetError as e:
            over.append(e)
            continue
        if best is None or plan.total_s < best.total_s:
            best = plan
    if best is None and over:  # none fits: the one that came closest says by how much
        raise min(over, key=lambda e: e.smallest_bytes)
    if best is None:
        raise SolverError(f"no layout of the buffers {local.names[:2]}... splitting dims {local.split_dims} was tried "
                          f"on mesh {mesh.shape}; pass LocalBuffers a layout, or leave them out of local_buffers")
    return best
