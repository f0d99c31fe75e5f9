"""The predicted cost of any Plan - autopar's, a hand plan, one read from JSON - under a
cost model of your choice, priced exactly as the solver prices its own candidates.

    evaluate(plan)                    the preset the plan was made for
    evaluate(plan, device="h100")     the same layouts on other hardware
    evaluate(plan, cost_model=costs)  a CostModel built from a measured profile
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from autopar.core.plan import Plan
from autopar.cost_models.memory import node_bytes
from autopar.cost_models.model import CostModel


@dataclass(frozen=True)
class Evaluation:
    compute_s: float  # per rank, one step
    comm_s: float  # per rank, one step (forward collectives, and in training their conjugates and syncs)
    memory_bytes: int  # per rank: parameters (+ gradients and optimiser state in training) and activations

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    def __str__(self) -> str:
        return (f"{self.total_s * 1e3:.3f} ms/step (compute {self.compute_s * 1e3:.3f}, comm {self.comm_s * 1e3:.3f}), "
                f"{self.memory_bytes / 2**20:.1f} MiB/rank")


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
    costs = cost_model or CostModel.analytic(device or plan.device, plan.mesh.shape, training)
    if costs.mesh_shape != plan.mesh.shape:
        raise ValueError(f"cost model is for mesh {costs.mesh_shape} but the plan is for {plan.mesh.shape}")
    compute_s, memory = 0.0, 0
    for n in plan.nodes:
        target = None
        if n.kind.computes:
            target = op_target(n.op, n.name)
            compute_s += costs.op_cost(target, n.inputs, n.outputs).compute_s
        memory += node_bytes(n.kind, target, n.outputs, plan.mesh.shape, costs.training, optimizer_state_bytes)
    comm_s = sum(costs.steps_cost(e.steps).total_s for e in plan.edges)
    return Evaluation(compute_s, comm_s, memory)
