"""Which rules sharded each model: hand-written, discovered by experiment, or none
(replicated), and the plan's predicted step time against running every op replicated.

    python -m autopar coverage [models...] [--mesh 2,4] [--device cpu] [--training] [--ops]
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.placement import R, Spec
from autopar.cost_models.model import CostModel
from autopar.passes.plan.planning import plan_traced
from autopar.passes.trace.trace import trace
from autopar.tools import zoo


@dataclass(frozen=True)
class CoverageRow:
    model: str
    ops: dict[str, Counter] = field(default_factory=dict)  # rule source -> op name -> count
    plan_s: float = 0.0
    replicated_s: float = 0.0
    error: str = ""

    @property
    def speedup(self) -> float:
        return self.replicated_s / self.plan_s if self.plan_s else 0.0


def all_replicated_s(graph, costs: CostModel) -> float:
    """Every op whole on every rank: the compute of one device, and no communication."""
    total = 0.0
    for n in graph.nodes:
        if n.call is not None:
            ins = tuple(Spec((R,) * len(costs.mesh_shape), m) for m in n.call.inputs)
            outs = tuple(Spec((R,) * len(costs.mesh_shape), m) for m in n.call.outputs)
            total += costs.op_cost(n.call.target, ins, outs, n.call.causal).compute_s
    return total


def coverage_of(name: str, mesh: tuple[int, ...], options: Options) -> CoverageRow:
    try:
        model, args, kwargs = zoo.build(name, training=bool(options.training))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph, plan = plan_traced(trace(model, args, kwargs), Mesh.of(mesh), options)
    except Exception as e:  # noqa: BLE001 - a model that fails is a row of the report, not the end of it
        return CoverageRow(name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    ops: dict[str, Counter] = {"hand": Counter(), "discovered": Counter(), "replicated": Counter()}
    for n in graph.nodes:
        if n.call is not None:
            ops[n.rule_source][n.op] += 1
    costs = CostModel.analytic(options.device, tuple(mesh), plan.training)
    return CoverageRow(name, ops, plan.total_s, all_replicated_s(graph, costs))


def coverage(names: list[str], mesh: tuple[int, ...], options: Optional[Options] = None) -> list[CoverageRow]:
    return [coverage_of(n, mesh, options or Options()) for n in names]


def report(rows: list[CoverageRow], mesh: tuple[int, ...], hand_ops: bool = False) -> str:
    """`hand_ops`: also list the ops hand-written rules sharded (discovered and replicated
    ones are always listed)."""
    lines = [f"coverage on mesh {mesh}: op nodes by rule source; predicted ms/step vs all-replicated",
             f"{'model':<15} {'hand':>5} {'disc':>5} {'repl':>5} {'plan ms':>9} {'repl ms':>9} {'speedup':>7}"]
    for r in rows:
        if r.error:
            lines.append(f"{r.model:<15} FAILED {r.error}")
            continue
        count = {k: sum(c.values()) for k, c in r.ops.items()}
        lines.append(f"{r.model:<15} {count['hand']:5d} {count['discovered']:5d} {count['replicated']:5d} "
                     f"{r.plan_s * 1e3:9.3f} {r.replicated_s * 1e3:9.3f} {r.speedup:6.2f}x")
        for source in ("hand", "discovered", "replicated") if hand_ops else ("discovered", "replicated"):
            if r.ops[source]:
                lines.append(f"    {source}: " + ", ".join(f"{op} x{k}" for op, k in sorted(r.ops[source].items())))
    return "\n".join(lines)
