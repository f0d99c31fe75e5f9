"""A first plan for the solver: the layouts a coarser mesh's plan chose, carried onto a mesh
with one more axis.

    Mesh (.., a, b, ..)           -> (.., a*b, ..) and the axis merged     (merges, merged_axes)
    Plan on (.., a*b, ..), axis k -> StartingLayouts on (.., a, b, ..)     (refined)
    StartingLayouts, IlpModel, IlpVariables -> group -> choice               (starting_picks)
    group -> choice, IlpModel, Ilp -> the solver's starting columns          (starting_solution)

Why: a three-axis mesh has several times the layouts of a two-axis one, and its ILP can be
too large for HiGHS to find a good plan within its time limit (the Llama-3-8B shape on
(2, 2, 2): 3.2 million columns, 414 ms found in 120 s against a proven bound of 152 ms).
Every plan of (.., a*b, ..) is a plan of (.., a, b, ..): rank r has the same coordinates
outside axis k, and its index i on the merged axis is i_k * b + i_(k+1), which is the
block a shard over axis k then axis k+1 gives it. So a placement p on the merged axis is
(p, p) on the two: a shard of a dim split a*b ways is the same dim split a then b ways,
a partial sum stays partial on both, a replica is a replica on both. Handed to HiGHS as
its first incumbent, that plan bounds the search from the start (the same 8B shape:
158 ms within the same limit).

Where the start sets every group it is handed over whole: every column's value, each flow
x[e,o,r] at 1 exactly where both its classes are picked and nothing recomputed, so the
solver only checks it. A partial start leaves the solver to complete it, which on a model
of millions of columns is a solve of its own (the 3-layer shape on (2, 2, 2) under a 10 s
limit did not finish it).

The start is a hint, never a constraint: a node whose carried layouts are not among its
strategies on the finer mesh (an uneven shard, which one axis only may split), or whose
choice dominance pruning removed, is left for the solver to complete. When the solver
stops before it has any plan (a time limit) and the start sets every group, the start is
the plan (passes/solve/solve.py), so a three-axis mesh under a short limit gets at least
its merged mesh's plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from autopar.core.mesh import Mesh
from autopar.core.placement import Placement, Spec
from autopar.core.plan import Plan
from autopar.passes.solve.ilp import Ilp, IlpModel, IlpVariables

Layouts = tuple[tuple[Placement, ...], ...]  # one tuple of placements per tensor


@dataclass(frozen=True)
class StartingLayouts:
    """Per node, the placements of its inputs and of its outputs in the plan to start from."""

    source: tuple[int, ...]  # the mesh of the plan these came from
    layouts: Mapping[str, tuple[Layouts, Layouts]]


def merges(mesh: Mesh) -> tuple[tuple[Mesh, int], ...]:
    """The mesh with each pair of adjacent axes of size 2 or more merged, outermost pair
    first, each with the merged axis's index; none when the mesh has fewer than three such
    axes (a two-axis ILP is solved directly). Any of them can start the solve: a caller
    that has planned several hands the cheapest (passes/plan/mesh_choice.py)."""
    if sum(n > 1 for n in mesh.shape) < 3:
        return ()
    shape = mesh.shape
    return tuple((Mesh(shape[:k] + (shape[k] * shape[k + 1],) + shape[k + 2:]), k)
                 for k in range(len(shape) - 1) if shape[k] > 1 and shape[k + 1] > 1)


def merged_axes(mesh: Mesh) -> Optional[tuple[Mesh, int]]:
    """The merge a solve starts from when it is handed none: the innermost pair."""
    merged = merges(mesh)
    return merged[-1] if merged else None


def refined(plan: Plan, axis: int) -> StartingLayouts:
    """`plan`'s layouts with mesh axis `axis` split in two (module docstring)."""
    def split(specs: tuple[Spec, ...]) -> Layouts:
        return tuple(s.placements[:axis] + (s.placements[axis],) * 2 + s.placements[axis + 1:] for s in specs)
    return StartingLayouts(plan.mesh.shape, {n.name: (split(n.inputs), split(n.outputs)) for n in plan.nodes})


def starting_picks(model: IlpModel, variables: IlpVariables, start: StartingLayouts) -> dict[str, int]:
    """Group -> the choice its leader's carried layouts are, for every group (a copy of a
    repeated block as its representative) where that choice is live."""
    picks: dict[str, int] = {}
    for g in model.leaders:
        owner = model.owner(g)
        if owner != g:
            if owner in picks:
                picks[g] = picks[owner]
            continue
        want = start.layouts.get(g)
        for i, strategy in enumerate(model.graph.node(g).strategies if want is not None else ()):
            if (tuple(s.placements for s in strategy.inputs) == want[0]
                    and tuple(s.placements for s in strategy.outputs) == want[1]):
                if variables.s[g][i] is not None:
                    picks[g] = i
                break
    return picks


def starting_solution(model: IlpModel, ilp: Ilp, picks: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """(columns, values) for the solver: the picked s columns at 1; where `picks` sets
    every group, every column (module docstring), else those alone."""
    on = {ilp.variables.s[g][i] for g, i in picks.items()}
    if len(picks) < len(model.leaders):
        columns = np.array(sorted(on), dtype=np.int32)
        return columns, np.ones(len(columns))
    values = np.zeros(len(ilp.program.cost))
    values[list(on)] = 1.0
    for x, src, dst in ilp.variables.flows:
        if any(v in on for v in src) and any(v in on for v in dst):
            values[x] = 1.0
    return np.arange(len(values), dtype=np.int32), values
