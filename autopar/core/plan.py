"""The Plan: the contract between planning and execution.

It holds, for every node of the traced graph, the chosen strategy (a spec per input
and output), for every edge the reshard steps the rewrite will insert, the predicted
per-rank compute, communication and memory, and the solver's report. It names nodes,
never graph objects, so it can be saved and checked against a model by fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Optional

from autopar.core import plan_io
from autopar.core.kinds import NodeKind
from autopar.core.links import AxisLink
from autopar.core.mesh import Mesh
from autopar.core.pipeline import PipelinePlan
from autopar.core.plan_parts import Collective, EdgePlan, MeshCandidate, NodeChoice, RecomputedBlock, SolverReport


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
    state_bytes: int = 0  # per rank: gradients and optimiser state (training plans)
    cost_note: str = ""  # where the costs came from (preset, or profile and how many timings it lacked)
    discovered_ops: tuple[str, ...] = ()  # ops sharded by rules found by experiment (passes/strategies/discovery.py)
    # why a sort by expert was not made a routed_experts op (passes/trace/experts.py): its experts stay unsplit
    routing_notes: tuple[str, ...] = ()
    # stages, schedule and microbatches when a mesh axis pipelines (autopar/core/pipeline.py);
    # the nodes and edges are then empty: each stage has its own plan, of its own module
    # on its sub-mesh, in stage_plans
    pipeline: Optional[PipelinePlan] = None
    # blocks recomputed in backward instead of keeping their activations (the ILP's choice under a budget)
    recompute: tuple[RecomputedBlock, ...] = ()
    links: tuple[AxisLink, ...] = ()  # per mesh axis: the link its collectives were priced with, and its kind
    # of comm_s, the seconds that run under compute (gradient buckets under backward: cost_models/overlap.py)
    hidden_s: float = 0.0
    # backwards per data-parallel gradient reduction (Options.grad_sync_every: a pipeline
    # stage's microbatches); comm_s counts each backward's 1/n of it (cost_models/overlap.py)
    grad_sync_every: int = 1
    # a pipelined plan: each stage's plan, in stage order (passes/plan/pipeline_stages.py); empty
    # when the stages are planned where they run (a profiled cost model times them there)
    stage_plans: tuple["Plan", ...] = ()
    # mesh="auto": every mesh the planner tried, this plan's among them (empty: the mesh was given)
    mesh_candidates: tuple[MeshCandidate, ...] = ()

    @property
    def memory_bytes(self) -> int:
        return self.param_bytes + self.state_bytes + self.activation_bytes

    @property
    def total_s(self) -> float:
        """The predicted step: compute and the communication it does not hide."""
        return self.compute_s + self.comm_s - self.hidden_s

    def node(self, name: str) -> NodeChoice:
        found = self._node_by_name.get(name)
        if found is not None:
            return found
        raise KeyError(f"plan has no node {name!r}; nodes are named as in the traced graph (e.g. 'linear_3')")

    @functools.cached_property
    def _node_by_name(self) -> dict[str, NodeChoice]:
        # the rank program reads its output node's choice on every call
        return {n.name: n for n in self.nodes}

    def placements(self) -> dict[str, str]:
        """Node name -> placement string of its (first) output, e.g. {'linear': 'S(0)R'}."""
        return {n.name: str(n.outputs[0]) for n in self.nodes if n.outputs}

    def collectives(self, include_grad_only: bool = False) -> tuple[Collective, ...]:
        out = []
        for e in self.edges:
            for s in e.steps:
                if s.kind.communicates or (include_grad_only and s.backward.communicates):
                    nbytes = s.before.local_nbytes(self.mesh.shape) if s.before is not None else 0
                    out.append(Collective(s.kind, s.axis, nbytes, e.producer, e.consumer, s.backward))
        return tuple(out)

    def summary(self) -> str:
        cols = self.collectives()
        kinds: dict[str, int] = {}
        for c in cols:
            kinds[f"{c.kind}@axis{c.axis}"] = kinds.get(f"{c.kind}@axis{c.axis}", 0) + 1
        params = [n for n in self.nodes if n.kind is NodeKind.PARAMETER]
        sharded = sum(1 for n in params if not n.outputs[0].is_replicated())
        lines = [
            f"Plan for {self.model_name} on mesh {self.mesh.shape} ({'training' if self.training else 'inference'}, "
            f"cost model {self.device})",
            f"  predicted per rank: step {self.total_s * 1e3:.3f} ms: compute {self.compute_s * 1e3:.3f} ms, "
            f"communication {self.comm_s * 1e3:.3f} ms ({self.hidden_s * 1e3:.3f} hidden under compute), "
            f"memory {self.memory_bytes / 2**20:.2f} MiB (params {self.param_bytes / 2**20:.2f} MiB)",
            f"  parameters sharded: {sharded}/{len(params)}; forward collectives: {len(cols)} "
            + (f"({', '.join(f'{k} x{v}' for k, v in sorted(kinds.items()))})" if kinds else ""),
            f"  solver: {self.solver.solver} {self.solver.status}, objective {self.solver.objective_s * 1e3:.3f} ms"
            + (f" (proven bound {self.solver.bound_s * 1e3:.3f} ms, gap {self.solver.gap or 0.0:.2%})"
               if self.solver.bound_s is not None else " (no bound proven)") + ", "
            f"{self.solver.variables} variables, {self.solver.constraints} constraints, "
            f"{self.solver.solve_time_s:.2f} s"
            + (f", {self.solver.shared_blocks} repeated blocks sharing variables" if self.solver.shared_blocks else "")
            + (f", started from {self.solver.start}" if self.solver.start else ""),
        ]
        if self.recompute:
            lines.append(f"  recomputed in backward: {', '.join(b.name for b in self.recompute)}")
        if self.grad_sync_every > 1:
            lines.append(f"  data-parallel gradients all-reduced once per {self.grad_sync_every} backwards (a pipeline "
                         f"stage's microbatches); each backward priced 1/{self.grad_sync_every} of it")
        if self.cost_note:
            lines.append(f"  costs: {self.cost_note}")
        if self.pipeline is not None:
            lines.append(self.pipeline.summary())
            lines.append(f"  stage plans: {len(self.stage_plans)} stored (the stages run without solving)"
                         if self.stage_plans else "  stage plans: none stored (each stage solves where it runs)")
            for k, sp in enumerate(self.stage_plans):
                stored = [n for n in sp.nodes if n.kind is NodeKind.PARAMETER]
                lines.append(f"    stage {k}: memory {sp.memory_bytes / 2**20:.2f} MiB, parameters sharded "
                             f"{sum(not n.outputs[0].is_replicated() for n in stored)}/{len(stored)}, recomputed "
                             f"{len(sp.recompute)} block{'s' * (len(sp.recompute) != 1)}")
        if self.links:
            lines.append("  links: " + "; ".join(f"axis {a} {link}" for a, link in enumerate(self.links)))
        if self.mesh_candidates:
            unproven = sum(c.bound_s is not None for c in self.mesh_candidates)
            lines.append(f"  mesh: {self.mesh.shape} chosen, the cheapest of {len(self.mesh_candidates)} tried"
                         + (f", {unproven} of them not solved to a proven optimum" if unproven else "")
                         + " (plan.explain_mesh() lists them)")
        if self.unruled_ops:
            lines.append(f"  replicated for want of a rule: {', '.join(self.unruled_ops)}")
        if self.discovered_ops:
            lines.append(f"  sharded by discovered rules: {', '.join(self.discovered_ops)}")
        for note in self.routing_notes:
            lines.append(f"  not expert-parallel: {note}")
        return "\n".join(lines)

    def table(self) -> str:
        """One line per node: name, op, output placement(s)."""
        w = max((len(n.name) for n in self.nodes), default=4)
        return "\n".join(f"{n.name:<{w}}  {','.join(str(s) for s in n.outputs) or '-':<12} {n.op}"
                         for n in self.nodes)

    def __str__(self) -> str:
        return self.summary()

    # ---- reading a plan ---------------------------------------------------------
    def explain_mesh(self) -> str:
        """For mesh="auto": every mesh tried, its predicted step and memory (or why it was
        refused), the chosen one marked."""
        if not self.mesh_candidates:
            return f"mesh {self.mesh.shape} was given, not chosen (mesh=\"auto\" tries the factorisations)"
        return "\n".join(("* " if c.shape == self.mesh.shape else "  ") + str(c) for c in self.mesh_candidates)

    def explain(self, node: "str | object") -> str:
        """The strategies the solver had for `node` (a name or an fx.Node), each priced
        with every other node at its chosen strategy, and why the chosen one won."""
        name = node if isinstance(node, str) else getattr(node, "name", str(node))
        n = self.node(name)
        chosen = next((a for a in n.options if a.inputs == n.inputs and a.outputs == n.outputs), None)
        lines = [f"{n.name} ({n.op}{', in ' + n.module if n.module else ''}): {len(n.options)} strategies; "
                 f"times in microseconds, others held at the plan"]
        lines.append(f"  {'':2}{'compute':>10}{'reshard in':>12}{'reshard out':>12}{'total':>10}  strategy")
        for a in sorted(n.options, key=lambda a: (a.total_s, a.label())):
            mark = "->" if a is chosen else ""
            fmt = [f"{x * 1e6:.2f}" if x != float("inf") else "inf"
                   for x in (a.compute_s, a.reshard_in_s, a.reshard_out_s, a.total_s)]
            lines.append(f"  {mark:2}{fmt[0]:>10}{fmt[1]:>12}{fmt[2]:>12}{fmt[3]:>10}  {a.label()}")
        best = min(n.options, key=lambda a: a.total_s, default=None)
        if chosen is None or best is None:
            lines.append("  why: the node has no recorded alternatives")
        elif chosen.total_s <= best.total_s * (1 + 1e-9):
            lines.append("  why: it is the cheapest strategy given its neighbours' choices")
        else:
            lines.append(f"  why: it moves with {n.group or 'its group'} (a follower shares its leader's choice); "
                         "a cheaper local choice would cost more elsewhere in that group")
        return "\n".join(lines)

    def diff(self, other: "Plan") -> str:
        """Nodes whose placements differ between two plans of the same graph, and the cost delta."""
        if self.fingerprint != other.fingerprint:
            head = (f"plans are for different graphs ({self.model_name} {self.fingerprint} vs "
                    f"{other.model_name} {other.fingerprint}); comparing nodes by name")
        else:
            head = f"plans for {self.model_name} ({self.fingerprint})"
        mine = {n.name: n for n in self.nodes}
        lines = [head, f"  mesh {self.mesh.shape} vs {other.mesh.shape}",
                 f"  total {self.total_s * 1e3:.3f} ms vs {other.total_s * 1e3:.3f} ms "
                 f"(delta {(other.total_s - self.total_s) * 1e3:+.3f} ms; compute "
                 f"{(other.compute_s - self.compute_s) * 1e3:+.3f}, communication "
                 f"{(other.comm_s - self.comm_s) * 1e3:+.3f})",
                 f"  memory per rank {self.memory_bytes / 2**20:.2f} MiB vs {other.memory_bytes / 2**20:.2f} MiB"]
        changed = []
        for n in other.nodes:
            a = mine.get(n.name)
            if a is None:
                changed.append(f"    {n.name}: only in the second plan")
            elif [str(s) for s in a.outputs] != [str(s) for s in n.outputs] or a.inputs != n.inputs:
                changed.append(f"    {n.name}: {','.join(map(str, a.outputs))} -> {','.join(map(str, n.outputs))}"
                               f"  (compute {(n.compute_s - a.compute_s) * 1e6:+.2f} us)")
        changed += [f"    {name}: only in the first plan" for name in mine if name not in {n.name for n in other.nodes}]
        lines.append(f"  {len(changed)} nodes differ" + (":" if changed else ""))
        return "\n".join(lines + changed)

    # ---- artifacts -------------------------------------------------------------
    def to_dict(self) -> dict:
        """The JSON-ready form (schema in autopar/core/plan_io.py)."""
        return plan_io.plan_to_dict(self)

    @staticmethod
    def from_dict(data: dict, source: str = "<dict>") -> "Plan":
        """A Plan from its JSON-ready form; PlanFileError naming `source` if it is not one."""
        return Plan._of(plan_io.plan_fields(data, source), source)

    def to_json(self, path) -> None:
        """Save atomically as JSON: a reader sees the old file or the new one, never half."""
        plan_io.save(self, path)

    @staticmethod
    def from_json(path) -> "Plan":
        """Load and validate a saved plan; PlanFileError naming the file if it is unusable."""
        return Plan._of(plan_io.load_fields(path), f"plan file {path}")

    @staticmethod
    def _of(fields: dict, source: str) -> "Plan":
        """A Plan from plan_io's fields, whose stage plans are still JSON-ready dicts."""
        stages = tuple(Plan.from_dict(d, f"{source}, stage {k}") for k, d in enumerate(fields["stage_plans"]))
        return Plan(**{**fields, "stage_plans": stages})

    def digest(self) -> str:
        """A hash of everything that decides what the ranks run (placements and steps)."""
        h = hashlib.sha256(repr((self.mesh.shape, self.fingerprint)).encode())
        for n in self.nodes:
            h.update(repr((n.name, [str(s) for s in n.inputs], [str(s) for s in n.outputs])).encode())
        for e in self.edges:
            h.update(repr((e.producer, e.index, e.consumer, e.position, [str(s) for s in e.steps])).encode())
        for b in self.recompute:  # absent from plans without recompute, whose digest stays as it was
            h.update(repr((b.name, b.nodes)).encode())
        if self.pipeline is not None:  # absent from unpipelined plans, whose digest stays as it was
            h.update(repr(plan_io.pipeline_to_json(self.pipeline)).encode())
        for stage in self.stage_plans:
            h.update(stage.digest().encode())
        return h.hexdigest()[:16]
