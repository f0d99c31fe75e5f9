"""The cost model the solver reads: seconds for an op under a strategy, seconds for
a reshard step (forward and its conjugate backward), bytes per rank.

Compute comes from the analytic roofline; a profile (measured times keyed by op, local
shapes, dtype and device) plugs in through `compute_table` (forward) and
`backward_table` and takes priority where it has an entry."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Any, Callable, Optional

import torch

from autopar.core.kinds import StepKind
from autopar.core.placement import Spec, TensorMeta, local_shape
from autopar.core.resharding import Step
from autopar.core.routed import ROUTED_EXPERTS
from autopar.cost_models import comm, compute
from autopar.cost_models.attention import CausalScores, causal_scores, swaps_s
from autopar.cost_models.devices import DeviceSpec, Link, preset

SDPA = torch.ops.aten.scaled_dot_product_attention.default

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
    def op_cost(self, target: Any, inputs: tuple[Spec, ...], outputs: tuple[Spec, ...], causal: bool = False
                ) -> Cost:
        """`causal`: the op is sdpa with is_causal (cost_models/attention.py prices the
        pairs its kernel skips and the balanced form's swaps)."""
        if target is ROUTED_EXPERTS:
            return self.routed_experts_cost(inputs, outputs)
        li = tuple(self.local(s) for s in inputs)
        lo = tuple(self.local(s) for s in outputs)
        scores = causal_scores(inputs, self.mesh_shape) if causal and target is SDPA else CausalScores(1.0)
        # a measured time is the local call's: the masked form where the balanced one runs
        measured_share = scores.share if scores.axis is not None else 1.0
        fwd = None
        if self.compute_table is not None:
            fwd = self.compute_table(target, li, lo)
            fwd = None if fwd is None else fwd * measured_share
        if fwd is None:
            fwd = compute.compute_s(self.device, target, li, lo, scores.share)
        bwd = 0.0
        if self.training:
            bwd = self.backward_table(target, li, lo) if self.backward_table is not None else None
            bwd = fwd * compute.backward_factor(target, lo) if bwd is None else bwd * measured_share
        comm_s = 0.0 if scores.axis is None else \
            swaps_s(inputs, outputs, self.mesh_shape, self.link(scores.axis), self.training, self.collective_sync_s)
        return Cost(compute_s=(fwd + bwd) * self.compute_scale, comm_s=comm_s)

    def routed_experts_cost(self, inputs: tuple[Spec, ...], outputs: tuple[Spec, ...]) -> Cost:
        """routed_experts (autopar/core/routed.py, inputs: ids, row sources, experts) with
        balanced routing: a rank computes S / ways rows, `ways` the product of the axes
        that split the ids or the experts (an axis that splits both counts once: its rank
        receives every source's rows of its experts), each row through every expert
        weight [E, a, b] as a matmul (2ab FLOPs). Where ids and experts are split on one
        axis, the rows travel there and back: an all-to-all per row source and one of the
        results, forward and again backward, and one of the per-expert counts."""
        ids, out, count = inputs[0], outputs[0], _trailing_experts(inputs)
        sources, experts = inputs[1:len(inputs) - count], inputs[len(inputs) - count:]
        routed = set(ids.shard_axes(0)) | set(inputs[-1].shard_axes(0))
        rows = ids.meta.shape[0] / prod(self.mesh_shape[a] for a in routed)
        width = prod(out.meta.shape[1:])
        flops = sum(2.0 * rows * s.meta.shape[1] * s.meta.shape[2] for s in experts if len(s.meta.shape) == 3)
        dtype = out.meta.dtype
        moved = sum(prod(self.local(s).shape) * s.meta.dtype.itemsize for s in inputs[1:]) + \
            rows * width * dtype.itemsize
        fwd = max(flops / self.device.flops_per_s(dtype), moved / self.device.mem_bw_bytes_per_s) + \
            self.device.op_overhead_s
        compute_s = fwd * (3.0 if self.training else 1.0) * self.compute_scale
        comm_s = 0.0
        for axis in set(ids.shard_axes(0)) & set(inputs[-1].shard_axes(0)):
            n, link = self.mesh_shape[axis], self.link(axis)
            local_rows = prod(self.local(ids).shape)
            sent = [local_rows * prod(s.meta.shape[1:]) * s.meta.dtype.itemsize for s in sources]
            calls = sent + [local_rows * width * dtype.itemsize]  # each source there, the results back
            there_and_back = sum(comm.all_to_all_s(b, n, link) + self.collective_sync_s for b in calls)
            counts = comm.all_to_all_s(8 * inputs[-1].meta.shape[0], n, link) + self.collective_sync_s
            comm_s += there_and_back * (2.0 if self.training else 1.0) + counts
        return Cost(compute_s=compute_s, comm_s=comm_s)

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


def _trailing_experts(inputs: tuple[Spec, ...]) -> int:
    """How many of routed_experts' last inputs are experts: those of the last one's
    expert count E (dim 0) and two or more dims (the row sources before them are
    the routing weights [S] and the tokens [T, H])."""
    e, count = inputs[-1].meta.shape[0], 0
    for s in reversed(inputs[1:]):
        if len(s.meta.shape) < 2 or s.meta.shape[0] != e:
            break
        count += 1
    return count

