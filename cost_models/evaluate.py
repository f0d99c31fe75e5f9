"""The predicted cost of any Plan - autopar's, a hand plan, one read from JSON - under a
cost model of your choice, priced exactly as the solver prices its own candidates.

    evaluate(plan)                    the preset the plan was made for
    evaluate(plan, device="h100")     the same layouts on other hardware
    evaluate(plan, cost_model=costs)  a CostModel built from a measured profile

Training steps credit the gradient buckets' all-reduces that run under backward
(cost_models/overlap.py): total_s is compute plus the communication not hidden, as
the solver's objective counts it.

Blocks the plan recomputes (Plan.recompute) are priced as the solver prices them
(passes/solve/recompute_ilp.py): their forward once more, and none of the bytes of their
outputs read only inside the block (recompute_terms).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence

import torch

from autopar.core.kinds import NodeKind
from autopar.core.plan import Plan
from autopar.core.plan_parts import EdgePlan, NodeChoice, RecomputedBlock
from autopar.cost_models.memory import node_bytes
from autopar.cost_models.model import CostModel
from autopar.cost_models.hiding import amortised_s
from autopar.cost_models.overlap import plan_hidden_s


@dataclass(frozen=True)
class Evaluation:
    compute_s: float  # per rank, one step
    comm_s: float  # per rank, one step (forward collectives, and in training their conjugates and syncs)
    memory_bytes: int  # per rank: parameters (+ gradients and optimiser state in training) and activations
    hidden_s: float = 0.0  # of comm_s, what runs under compute (gradient buckets: cost_models/overlap.py)

    @property
    def exposed_comm_s(self) -> float:
        """Communication the step waits for."""
        return self.comm_s - self.hidden_s

    @property
    def total_s(self) -> float:
        """The predicted step time: compute and the communication it does not hide."""
        return self.compute_s + self.exposed_comm_s

    def __str__(self) -> str:
        return (f"{self.total_s * 1e3:.3f} ms/step (compute {self.compute_s * 1e3:.3f}, comm {self.comm_s * 1e3:.3f}, "
                f"of which hidden {self.hidden_s * 1e3:.3f}), {self.memory_bytes / 2**20:.1f} MiB/rank")


def op_target(op: str, node: str = "?") -> Any:
    """'aten.mm.default' -> torch.ops.aten.mm.default."""
    try:
        namespace, packet, overload = op.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (ValueError, AttributeError, RuntimeError):
        raise ValueError(f"node {node}: op {op!r} is not an operator this torch ({torch.__version__}) knows; "
                         "was the plan made with another torch version?") from None


def evaluate(plan: Plan, *, device: Optional[str] = None, training: Optional[bool] = None,
             cost_model: Optional[CostModel] = None, optimizer_state_bytes: int = 8) -> Evaluation:
    training = plan.training if training is None else training
    costs = cost_model or _analytic_for(plan, device, training)
    if costs.mesh_shape != plan.mesh.shape:
        raise ValueError(f"cost model is for mesh {costs.mesh_shape} but the plan is for {plan.mesh.shape}")
    compute_s, op_comm_s, memory = 0.0, 0.0, 0
    for n in plan.nodes:
        target = None
        if n.kind.computes:
            target = op_target(n.op, n.name)
            cost = costs.op_cost(target, n.inputs, n.outputs, n.causal)
            compute_s, op_comm_s = compute_s + cost.compute_s, op_comm_s + cost.comm_s
        memory += node_bytes(n.kind, target, n.outputs, plan.mesh.shape, costs.training, optimizer_state_bytes,
                             n.saved, n.inputs)
    every = plan.grad_sync_every  # parameter edges pay 1/n of a bucket's reduction (hiding.amortised_s)
    params = {n.name for n in plan.nodes if n.kind is NodeKind.PARAMETER} if every > 1 else set()
    comm_s = op_comm_s + sum(costs.steps_cost(e.steps).total_s
                             - (amortised_s(e.steps, costs, every) if e.producer in params else 0.0)
                             for e in plan.edges)
    again = recompute_terms(plan.nodes, plan.edges, plan.recompute, costs)
    hidden = plan_hidden_s(plan.nodes, plan.edges, costs, least_backward_s(plan.nodes, costs),
                           least_forward_s(plan.nodes, costs), every) \
        if costs.training or costs.device.collectives_beside_compute else 0.0
    return Evaluation(compute_s + again.compute_s, comm_s + again.comm_s, memory + again.memory_bytes, hidden)


def least_forward_s(nodes: Sequence[NodeChoice], costs: CostModel) -> list[float]:
    """Per node, the least forward seconds among the strategies it could take: the
    compute a prefetched parameter gather surely hides under (cost_models/overlap.py)."""
    forward = replace(costs, training=False)
    return _least_over_options(nodes, lambda target, i, o, causal: forward.op_cost(target, i, o, causal).total_s)


def least_backward_s(nodes: Sequence[NodeChoice], costs: CostModel) -> list[float]:
    """Per node, the least backward seconds among the strategies it could take: the
    compute a gradient bucket surely hides under (cost_models/overlap.py, 1.)."""
    forward = replace(costs, training=False)
    return _least_over_options(nodes, lambda target, i, o, causal: costs.op_cost(target, i, o, causal).total_s
                               - forward.op_cost(target, i, o, causal).total_s)


def _least_over_options(nodes: Sequence[NodeChoice], seconds: Any) -> list[float]:
    """Per node, the least `seconds(target, inputs, outputs, causal)` over its options (the chosen
    layout where a plan lists none); 0 for nodes that compute nothing."""
    out = []
    for n in nodes:
        if not n.kind.computes:
            out.append(0.0)
            continue
        target = op_target(n.op, n.name)
        layouts = [(a.inputs, a.outputs) for a in n.options] or [(n.inputs, n.outputs)]
        out.append(min(seconds(target, i, o, n.causal) for i, o in layouts))
    return out


def _analytic_for(plan: Plan, device: Optional[str], training: bool) -> CostModel:
    """The preset's model, with the links the plan was priced with (Plan.links: each
    axis's kind on the plan's nodes, and any Options.links override) when it is priced
    for its own device; another device brings its own links, every axis inside one node."""
    costs = CostModel.analytic(device or plan.device, plan.mesh.shape, training)
    if plan.links and (device is None or device == plan.device):
        costs = replace(costs, links=tuple(a.link for a in plan.links))
    return costs


def recompute_terms(nodes: Sequence[NodeChoice], edges: Sequence[EdgePlan], blocks: Sequence[RecomputedBlock],
                    costs: CostModel) -> Evaluation:
    """What recomputing `blocks` changes in a step: each block's forward runs once more
    (its ops' forward compute, the forward steps of the reshards into its nodes: they
    rerun in backward) and the bytes of its outputs read only inside it are not kept
    (memory_bytes: minus those bytes). An output read outside its block stays."""
    forward = replace(costs, training=False)
    by_name = {n.name: n for n in nodes}
    compute_s = comm_s = 0.0
    dropped = 0
    for block in blocks:
        inside = set(block.nodes)
        read_outside = {e.producer for e in edges if e.producer in inside and e.consumer not in inside}
        for name in block.nodes:
            n = by_name[name]
            target = op_target(n.op, name) if n.kind.computes else None
            if target is not None:
                compute_s += forward.op_cost(target, n.inputs, n.outputs, n.causal).compute_s
            if name not in read_outside:
                dropped += node_bytes(n.kind, target, n.outputs, costs.mesh_shape, costs.training, 0, n.saved)
        comm_s += sum(forward.steps_cost(e.steps).total_s for e in edges if e.consumer in inside)
    return Evaluation(compute_s, comm_s, -dropped)
