"""The cost model the solver reads: seconds for an op under a strategy, seconds for
a reshard step (forward and its conjugate backward), bytes per rank.

Compute comes from the analytic roofline; a profile (measured times keyed by op, local
shapes, dtype and device) plugs in through `compute_table` (forward) and
`backward_table` and takes priority where it has an entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Callable, Optional

from autopar.core.kinds import StepKind
from autopar.core.placement import Spec, TensorMeta, local_shape
from autopar.core.resharding import Step
from autopar.cost_models import comm, compute
from autopar.cost_models.devices import DeviceSpec, Link, preset

# (target, local inputs, local outputs) -> forward seconds, or None when not measured
ComputeTable = Callable[[Any, tuple, tuple], Optional[float]]


@dataclass(frozen=True)
class Cost:
    compute_s: float = 0.0
    comm_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.compute_s + other.compute_s, self.comm_s + other.comm_s)


@dataclass(frozen=True)
class CostModel:
    device: DeviceSpec
    mesh_shape: tuple[int, ...]
    training: bool = False
    links: tuple[Link, ...] = ()  # per mesh axis (DeviceSpec.axis_links); none: one node, all intra-node
    compute_table: Optional[ComputeTable] = field(default=None, compare=False)
    # measured backward seconds of an op at its local shapes (a profile's); where it has no
    # entry the backward is the forward times compute.backward_factor
    backward_table: Optional[ComputeTable] = field(default=None, compare=False)
    # measured links per (mesh axis, collective), from a calibration; take priority
    measured_links: dict = field(default_factory=dict, compare=False, hash=False)
    # compute slow-down at run time relative to the timings: CPU ranks sharing cores
    compute_scale: float = 1.0
    # seconds each collective call costs beyond its link's time: where ranks share cores
    # they reach it at different times and all wait for the last (Profile.collective_sync_s)
    collective_sync_s: float = 0.0

    @staticmethod
    def analytic(device: "str | DeviceSpec", mesh_shape: tuple[int, ...], training: bool = False, nodes: int = 1,
                 link_overrides: Optional[dict] = None) -> "CostModel":
        """The preset's roofline and links, each mesh axis priced with the link its
        groups use on `nodes` nodes (DeviceSpec.axis_links); `link_overrides` replaces
        the preset's link of a LinkKind."""
        spec = preset(device) if isinstance(device, str) else device
        return CostModel(spec, tuple(mesh_shape), training, spec.axis_links(tuple(mesh_shape), nodes, link_overrides))

    def link(self, axis: int) -> Link:
        if self.links:
            return self.links[axis]
        return self.device.intra_link  # no node layout given: one node, every axis inside it

    def local(self, spec: Spec) -> TensorMeta:
        return TensorMeta(spec.local_shape(self.mesh_shape), spec.meta.dtype)

    # ---- compute -------------------------------------------------------------
    def op_cost(self, target: Any, inputs: tuple[Spec, ...], outputs: tuple[Spec, ...]) -> Cost:
        li = tuple(self.local(s) for s in inputs)
        lo = tuple(self.local(s) for s in outputs)
        fwd = None
        if self.compute_table is not None:
            fwd = self.compute_table(target, li, lo)
        if fwd is None:
            fwd = compute.compute_s(self.device, target, li, lo)
        bwd = 0.0
        if self.training:
            bwd = self.backward_table(target, li, lo) if self.backward_table is not None else None
            if bwd is None:
                bwd = fwd * compute.backward_factor(target, lo)
        return Cost(compute_s=(fwd + bwd) * self.compute_scale)

    # ---- communication -------------------------------------------------------
    def _collective_s(self, kind: str, step: Step, local: int) -> float:
        """`local`: the bytes each rank holds before the step."""
        n = self.mesh_shape[step.axis]
        link = (self.measured_links.get((step.axis, kind)) if self.measured_links else None) or self.link(step.axis)
        if kind == "all_reduce":
            return comm.all_reduce_s(local, n, link)
        if kind == "all_gather":
            # forward: gathers `local` from each rank; as a backward of slice/reduce_scatter the
            # gradient being gathered is the size of the step's result
            full = local * n if step.kind == "all_gather" else local
            return comm.all_gather_s(full, n, link)
        if kind == "reduce_scatter":
            full = local * n if step.kind == "all_gather" else local
            return comm.reduce_scatter_s(full, n, link)
        if kind == "all_to_all":
            return comm.all_to_all_s(local, n, link)
        if kind in ("slice", "to_partial", "grad_sync", "identity"):
            return 0.0
        raise ValueError(f"unknown collective kind {kind!r}")

    def step_cost(self, step: Step) -> Cost:
        if step.before is None:
            return Cost(comm_s=self._step_s(step, 0, True))
        meta = step.before.meta
        return Cost(comm_s=self._step_s(step, step.before.local_nbytes(self.mesh_shape), meta.dtype.is_floating_point))

    def step_s(self, step: Step, local: int, differentiable: bool) -> float:
        """Seconds of `step` (forward, and backward in training) on `local` bytes per rank."""
        return self._step_s(step, local, differentiable)

    def _step_s(self, step: Step, local: int, differentiable: bool) -> float:
        fwd = self._collective_s(step.kind, step, local) + self._sync_s(step.kind)
        # integer and boolean values (ids, masks) carry no gradient: their backward never runs
        bwd = 0.0
        if self.training and differentiable:
            bwd = self._collective_s(step.backward, step, local)
            if step.kind is not StepKind.GRAD_SYNC:  # a grad sync's reduction goes into a bucket: one wait per bucket
                bwd += self._sync_s(step.backward)
        return fwd + bwd

    def _sync_s(self, kind: StepKind) -> float:
        return self.collective_sync_s if kind.communicates else 0.0

    def moves_cost(self, moves: tuple[Step, ...], meta: TensorMeta) -> Cost:
        """steps_cost of resharding.reshard_moves' steps for the tensor `meta` (the
        planner prices ~10^4 of them and binds only the steps of the chosen plan)."""
        total = 0.0
        itemsize, differentiable = meta.dtype.itemsize, meta.dtype.is_floating_point
        for s in moves:
            shape = local_shape(s.before.placements, meta.shape, self.mesh_shape)
            total += self._step_s(s, prod(shape) * itemsize, differentiable)
        return Cost(comm_s=total)

    def steps_cost(self, steps: tuple[Step, ...]) -> Cost:
        total = Cost()
        for s in steps:
            total = total + self.step_cost(s)
        return total
