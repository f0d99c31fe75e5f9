"""The Plan: the contract between planning and execution.

It holds, for every node of the traced graph, the chosen strategy (a spec per input
and output), for every edge the reshard steps the rewrite will insert, the predicted
per-rank compute, communication and memory, and the solver's report. It names nodes,
never graph objects, so it can be saved and checked against a model by fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from autopar.mesh import Mesh
from autopar.resharding import COMMUNICATING, Step
from autopar.placement import Spec


@dataclass(frozen=True)
class NodeChoice:
    name: str
    op: str
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    compute_s: float
    alternatives: int  # how many strategies the solver could pick from
    module: str = ""  # the nn.Module path the op came from, e.g. "transformer.h.0.attn"

    def __str__(self) -> str:
        ins = ",".join(str(s) for s in self.inputs)
        outs = ",".join(str(s) for s in self.outputs)
        return f"{self.name}: ({ins}) -> {outs}"


@dataclass(frozen=True)
class EdgePlan:
    """What happens between output `index` of `producer` and input `position` of `consumer`."""

    producer: str
    index: int
    consumer: str
    position: int
    steps: tuple[Step, ...]
    comm_s: float


@dataclass(frozen=True)
class Collective:
    """One communicating step in forward order (its backward conjugate beside it)."""

    kind: str
    axis: int
    nbytes: int  # bytes this rank sends into the collective (its local buffer)
    producer: str
    consumer: str
    backward: str

    def __str__(self) -> str:
        return f"{self.kind}(axis {self.axis}, {self.nbytes} B) {self.producer} -> {self.consumer}"


@dataclass(frozen=True)
class SolverReport:
    solver: str
    status: str
    objective_s: float  # the ILP's objective; equals Plan.total_s when the model is exact
    gap: Optional[float]
    solve_time_s: float
    variables: int
    constraints: int
    groups: int  # decision groups (leaders) after following


@dataclass(frozen=True)
class Plan:
    mesh: Mesh
    model_name: str
    fingerprint: str
    training: bool
    device: str
    nodes: tuple[NodeChoice, ...]
    edges: tuple[EdgePlan, ...]
    compute_s: float  # predicted per-rank compute seconds of one step
    comm_s: float  # predicted per-rank communication seconds of one step
    param_bytes: int  # per rank: parameters and buffers held
    activation_bytes: int  # per rank: op outputs of one step (upper bound of what is live)
    solver: SolverReport
    unruled_ops: tuple[str, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.activation_bytes

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    def node(self, name: str) -> NodeChoice:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"plan has no node {name!r}; nodes are named as in the traced graph (e.g. 'linear_3')")

    def placements(self) -> dict[str, str]:
        """Node name -> placement string of its (first) output, e.g. {'linear': 'S(0)R'}."""
        return {n.name: str(n.outputs[0]) for n in self.nodes if n.outputs}

    def collectives(self, include_grad_only: bool = False) -> tuple[Collective, ...]:
        out = []
        for e in self.edges:
            for s in e.steps:
                if s.kind in COMMUNICATING or (include_grad_only and s.backward in COMMUNICATING):
                    nbytes = s.before.local_nbytes(self.mesh.shape) if s.before is not None else 0
                    out.append(Collective(s.kind, s.axis, nbytes, e.producer, e.consumer, s.backward))
        return tuple(out)

    def summary(self) -> str:
        cols = self.collectives()
        kinds: dict[str, int] = {}
        for c in cols:
            kinds[f"{c.kind}@axis{c.axis}"] = kinds.get(f"{c.kind}@axis{c.axis}", 0) + 1
        params = [n for n in self.nodes if n.op == "placeholder:parameter"]
        sharded = sum(1 for n in params if not n.outputs[0].is_replicated())
        lines = [
            f"Plan for {self.model_name} on mesh {self.mesh.shape} ({'training' if self.training else 'inference'}, "
            f"cost model {self.device})",
            f"  predicted per rank: compute {self.compute_s * 1e3:.3f} ms, communication {self.comm_s * 1e3:.3f} ms, "
            f"memory {self.memory_bytes / 2**20:.2f} MiB (params {self.param_bytes / 2**20:.2f} MiB)",
            f"  parameters sharded: {sharded}/{len(params)}; forward collectives: {len(cols)} "
            + (f"({', '.join(f'{k} x{v}' for k, v in sorted(kinds.items()))})" if kinds else ""),
            f"  solver: {self.solver.solver} {self.solver.status}, objective {self.solver.objective_s * 1e3:.3f} ms, "
            f"{self.solver.variables} variables, {self.solver.constraints} constraints, "
            f"{self.solver.solve_time_s:.2f} s",
        ]
        if self.unruled_ops:
            lines.append(f"  replicated for want of a rule: {', '.join(self.unruled_ops)}")
        return "\n".join(lines)

    def table(self) -> str:
        """One line per node: name, op, output placement(s)."""
        w = max((len(n.name) for n in self.nodes), default=4)
        return "\n".join(f"{n.name:<{w}}  {','.join(str(s) for s in n.outputs) or '-':<12} {n.op}"
                         for n in self.nodes)

    def __str__(self) -> str:
        return self.summary()
