"""Planning options: one frozen dataclass, a comment per field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from autopar.core.dynamic import Dynamic
from autopar.core.errors import OptionsError
from autopar.core.pipeline import PipelineError, Schedule
from autopar.core.links import link_overrides


@dataclass(frozen=True)
class Options:
    # device preset the analytic cost model plans for: "cpu", "a100", "h100", "h200"
    device: str = "cpu"
    # machines the mesh's ranks run on, node-major (with torchrun: --nnodes); a mesh axis
    # whose process groups all stay inside a node is priced with the preset's intra-node
    # link, one with any group spanning nodes with its inter-node link (core/mesh.py)
    nodes: int = 1
    # links to price with instead of the preset's, per kind, e.g.
    # {LinkKind.INTER: Link(alpha_s=20e-6, beta_s_per_byte=1 / 25e9, name="ib-200g")}; None: the preset's
    links: Optional[dict] = None
    # where costs come from: "analytic" (roofline + alpha-beta presets), "profile"
    # (measure on this machine at compile, cached in profile_path), or the path of a saved
    # profile (plan offline for hardware you do not have)
    cost_model: str = "analytic"
    # the profile file "profile" reads and extends; None:
    # ~/.cache/autopar/profile-<device name>-torch<version>.json
    profile_path: Optional[str] = None
    # seconds the compute profiler may spend per plan before leaving the rest analytic
    profile_budget_s: float = 120.0
    # plan for training (backward compute, conjugate collectives, gradient sync) or
    # inference; None lets model.training decide
    training: Optional[bool] = None
    # single-input ops follow their producer and placeholders with one use follow their
    # consumer, instead of getting free ILP variables (much smaller ILP, near-equal plans)
    follow: bool = True
    # identical repeated blocks (transformer layers) share one set of ILP variables, the
    # boundaries between blocks still priced edge by edge (passes/clusters.py): "inner"
    # (the first and last layer of a stack keep their own), "all", or "off" / False
    cluster_layers: "str | bool" = "inner"
    # ops without a hand-written rule get rules verified by experiment on random data
    # (passes/discovery.py); False: such ops run replicated
    discover_rules: bool = True
    # "auto" (HiGHS when highspy is installed, else CBC), "highs" or "cbc"
    solver: str = "auto"
    # wall-clock limit for the ILP solve; the best plan found so far is used after it
    time_limit_s: float = 120.0
    # seconds before a collective that does not complete raises instead of hanging
    collective_timeout_s: float = 300.0
    # per-rank bound on parameters, gradients, optimiser state and activations (bytes);
    # None for no bound. With a bound, parameters may be stored sharded and gathered
    # where they are used (ZeRO-3 / FSDP style)
    memory_budget_bytes: Optional[int] = None
    # optimiser state per parameter element in training: AdamW keeps two fp32 values
    optimizer_state_bytes: int = 8
    # collectives start as early as their input exists and are waited on just before
    # their result is used, with independent compute between (passes/schedule.py); their
    # backward conjugates likewise. False: every step runs whole where the rewrite put it
    overlap: bool = True
    # bytes of collectives in flight at once on a rank (a start waits for older ones
    # beyond it); bounds the memory that prefetched gathers hold
    max_inflight_bytes: int = 256 * 2**20
    # run each rank's program through torch.compile (Inductor), collectives inside the
    # compiled graph; falls back to eager with one warning where Inductor cannot run
    compile: bool = False
    # keyword arguments for torch.compile (fullgraph=True is the default), e.g. {"mode": "max-autotune"}
    compile_options: Optional[dict] = None
    # mixed precision, as FSDP2's MixedPrecisionPolicy: compute on copies of the floating
    # parameters and inputs in this dtype (e.g. torch.bfloat16) while the optimiser updates
    # the full-precision shards; outputs come back in the parameters' dtype. None: as is
    param_dtype: Optional[torch.dtype] = None
    # dtype gradient reductions run in (the data-parallel buckets and the backward of
    # reshard steps); None: the gradient's own dtype
    reduce_dtype: Optional[torch.dtype] = None
    # symbolic batch and sequence sizes (autopar/core/dynamic.py): one trace and one plan
    # serve every size in a range. True: wide default ranges, priced at the sizes of the
    # call that plans; Dynamic(batch=(lo, hi), seq=(lo, hi), plan_at=(b, s)): explicit
    dynamic: "bool | Dynamic" = False
    # pipeline parallelism (autopar/core/pipeline.py, passes/pipeline.py): the mesh axis whose
    # coordinate is the stage, "auto" (the planner decides whether and on which axis
    # pipelining pays), or None (no pipeline)
    pipeline_axis: "int | str | None" = None
    # microbatches per step when pipelining; they split dim 0 of every tensor input
    microbatches: int = 1
    # pipeline schedule: "gpipe", "1f1b" or "interleaved_1f1b" (autopar.Schedule)
    pipeline_schedule: "Schedule | str" = "1f1b"

    def __post_init__(self) -> None:
        Dynamic.of(self.dynamic)  # a clear OptionsError for anything else
        Schedule.of(self.pipeline_schedule)
        if self.pipeline_axis is not None and self.dynamic:
            raise PipelineError(f"pipeline_axis={self.pipeline_axis!r} with dynamic={self.dynamic!r}: pipelined "
                                "plans are made for one batch and sequence size; drop one of the two")
        link_overrides(self.links)  # likewise
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes < 1:
            raise OptionsError(f"Options.nodes={self.nodes!r} is not a positive int; pass the number of machines "
                               "the ranks run on (with torchrun: its --nnodes), 1 for one machine")
        for field_name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field_name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise OptionsError(f"Options.{field_name}={dtype!r} is not a floating-point torch dtype; use "
                                   "torch.bfloat16, torch.float16 or torch.float32 (or None)")
