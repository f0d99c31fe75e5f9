"""The pieces a Plan is made of: per-node choices, per-edge steps, the solver's report.

Plain frozen values, shared by the Plan (autopar/core/plan.py) and its file schema
(autopar/core/plan_io.py), which is why they live apart from the Plan class itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from autopar.core.kinds import NodeKind, StepKind
from autopar.core.placement import Spec
from autopar.core.resharding import Step


def strategy_label(inputs: tuple[Spec, ...], outputs: tuple[Spec, ...]) -> str:
    """"(S(0)R,RR) -> S(0)R": input placements, then output placements."""
    return f"({','.join(str(s) for s in inputs)}) -> {','.join(str(s) for s in outputs)}"


@dataclass(frozen=True)
class Alternative:
    """One strategy the solver could have picked for a node, priced with every other
    node held at its chosen strategy: its own compute, the reshards into it from its
    producers' chosen outputs, and from it into its consumers' chosen inputs."""

    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    compute_s: float
    reshard_in_s: float
    reshard_out_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.reshard_in_s + self.reshard_out_s

    def label(self) -> str:
        return strategy_label(self.inputs, self.outputs)


@dataclass(frozen=True)
class NodeChoice:
    name: str
    op: str  # the ATen overload ("aten.mm.default"), or "placeholder" / "getitem" / "output"
    inputs: tuple[Spec, ...]
    outputs: tuple[Spec, ...]
    compute_s: float
    alternatives: int  # how many strategies the solver could pick from
    module: str = ""  # the nn.Module path the op came from, e.g. "transformer.h.0.attn"
    options: tuple[Alternative, ...] = ()  # what the solver could pick (see Plan.explain)
    group: str = ""  # the decision group's leader (a follower moves with it)
    kind: NodeKind = NodeKind.OP  # graph input (which kind), getitem, output, or an op
    # training: per output, whether backward keeps it; the output node: per input, whether
    # the caller receives it (not a buffer's new value). Empty: all counted
    saved: tuple[bool, ...] = ()
    causal: bool = False  # sdpa with is_causal (priced by cost_models/attention.py)

    def __str__(self) -> str:
        return f"{self.name}: {strategy_label(self.inputs, self.outputs)}"


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

    kind: StepKind
    axis: int
    nbytes: int  # bytes this rank sends into the collective (its local buffer)
    producer: str
    consumer: str
    backward: StepKind

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
    groups: int  # decision groups with their own variables (after following and clustering)
    shared_blocks: int = 0  # repeated blocks that reused another block's variables
    # a proven lower bound on the objective: no plan in the search space is cheaper under
    # the cost model (None where the solver proved none)
    bound_s: Optional[float] = None
    # the plan the solver started from (passes/solve/warm_start.py); "" when it started from nothing
    start: str = ""


@dataclass(frozen=True)
class RecomputedBlock:
    """A repeated block (a transformer layer) whose activations are not kept for backward
    but recomputed there (torch.utils.checkpoint semantics), as the ILP chose under a
    memory budget (passes/solve/recompute_ilp.py). Outputs read outside the block are still
    kept; every other output of `nodes` is dropped after forward and made again."""

    name: str  # the block's module path, e.g. "transformer.h.3"
    nodes: tuple[str, ...]  # its op and getitem nodes, in graph order


@dataclass(frozen=True)
class MeshCandidate:
    """One mesh the planner tried for mesh="auto" (passes/plan/mesh_choice.py): its
    predicted step and memory per rank, or why no plan of it fits."""

    shape: tuple[int, ...]
    step_s: Optional[float]  # None: refused
    memory_bytes: Optional[int]
    refusal: str = ""
    # the solver's proven lower bound where it stopped short of proving its plan the
    # cheapest of the mesh (a time limit): a plan of this mesh may cost as little as this.
    # None: proven (or no bound)
    bound_s: Optional[float] = None

    def __str__(self) -> str:
        if self.step_s is None:
            return f"{self.shape}: {self.refusal}"
        out = f"{self.shape}: step {self.step_s * 1e3:.3f} ms, memory {(self.memory_bytes or 0) / 2**20:.2f} MiB"
        if self.bound_s is not None:  # Options.time_limit_s stopped the solver
            out += " (not proven the mesh's best: the solver stopped at its time limit"
            out += f"; no plan of it is under {self.bound_s * 1e3:.3f} ms)" if self.bound_s > 0 else ")"
        return out
