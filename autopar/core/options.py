"""Options: one frozen record of keyword options, validated and normalised when made.

Modes are enums (a string naming one is accepted and turned into it); each field holds
one fact (a profile's file is `profile_path`, not a cost-model mode). `options.planning`
and `options.running` are the two groups the stages read: what shapes the plan (its
search space, prices and solve), and how the ranks run it. Anything else is an
OptionsError naming the field and what to pass.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from autopar.core.dynamic import Dynamic
from autopar.core.errors import OptionsError
from autopar.core.kinds import TextEnum
from autopar.core.pipeline import PipelineAxis, PipelineError, Schedule
from autopar.core.links import link_overrides

# Options.memory_budget_bytes="auto": this share of the detected accelerator's memory (the
# rest for the CUDA context, NCCL's buffers, the allocator's fragmentation and what the
# cost model does not count)
MEMORY_AUTO = "auto"
DEVICE_BUDGET_FRACTION = 0.9
# bytes of data-parallel gradients all-reduced together (the runtime's buckets, and the
# cost model's overlap credit for them)
GRADIENT_BUCKET_BYTES = 25 * 2**20
# bytes of collectives in flight at once on a rank, by default: the gathered parameters of a few layers
INFLIGHT_CAP_BYTES = 256 * 2**20
# torch.compile's mode that replays CUDA graphs (Options.cuda_graphs)
CUDA_GRAPHS_MODE = "reduce-overhead"


class CostSource(TextEnum):
    """Where prices come from."""

    ANALYTIC = "analytic"  # roofline compute and alpha-beta links of the device preset
    PROFILE = "profile"  # measured on this machine at compile, cached in profile_path
    # a profile read from profile_path, nothing measured (plan for hardware you do not have);
    # without a profile_path, the one autopar ships for the device (cost_models/shipped.py)
    SAVED = "saved"


class Clustering(TextEnum):
    """Which identical repeated blocks share one set of ILP variables (passes/strategies/clusters.py)."""

    INNER = "inner"  # all but the first and last layer of a stack
    ALL = "all"
    OFF = "off"


class SolverChoice(TextEnum):
    AUTO = "auto"  # HiGHS when highspy is installed, else CBC
    HIGHS = "highs"
    CBC = "cbc"


@dataclass(frozen=True)
class Options:
    # device preset the analytic cost model plans for: "auto" (this process's accelerator:
    # a CUDA device's preset and memory, else "cpu"), "cpu", "a100", "h100", "h200", "b200",
    # one added with cost_models.devices.register_preset, or a DeviceSpec
    device: str = "auto"
    # machines the mesh's ranks run on, node-major (with torchrun: --nnodes); a mesh axis
    # whose process groups all stay inside a node is priced with the preset's intra-node
    # link, one with any group spanning nodes with its inter-node link (core/mesh.py)
    nodes: int = 1
    # links to price with instead of the preset's, per kind, e.g.
    # {LinkKind.INTER: Link(alpha_s=20e-6, beta_s_per_byte=1 / 25e9, name="ib-200g")}; None: the preset's
    links: Optional[dict] = None
    # where costs come from (CostSource): "analytic", "profile" (measured here, cached in
    # profile_path) or "saved" (read from profile_path, or the profile autopar ships for
    # the device where profile_path is None; nothing measured)
    cost_model: CostSource = CostSource.ANALYTIC
    # the profile file "profile" reads and extends and "saved" reads; None (for "profile"):
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
    # boundaries between blocks still priced edge by edge (passes/strategies/clusters.py): Clustering
    # "inner" (the first and last layer of a stack keep their own), "all" or "off"
    # (True and False are taken as "inner" and "off")
    cluster_layers: Clustering = Clustering.INNER
    # ops without a hand-written rule get rules verified by experiment on random data
    # (passes/strategies/discovery.py); False: such ops run replicated
    discover_rules: bool = True
    # SolverChoice: "auto" (HiGHS when highspy is installed, else CBC), "highs" or "cbc"
    solver: SolverChoice = SolverChoice.AUTO
    # wall-clock limit for the ILP solve; the best plan found so far is used after it
    time_limit_s: float = 120.0
    # relative gap at which the ILP solve stops: the plan's objective is then within this
    # fraction of the best the solver can prove (HiGHS's and CBC's mip gap)
    mip_gap: float = 1e-4
    # seconds before a collective that does not complete raises instead of hanging
    collective_timeout_s: float = 300.0
    # per-rank bound on parameters, gradients, optimiser state and activations (bytes);
    # None for no bound; "auto" (the default): DEVICE_BUDGET_FRACTION of the memory of the
    # accelerator device="auto" detected, where the fastest plan without a bound would not
    # fit it (passes/solve/solve.py); no bound on a CPU, a named preset or a saved profile. With a
    # bound, parameters may be stored sharded and gathered where they are used (ZeRO-3 /
    # FSDP style) and blocks recomputed
    memory_budget_bytes: "int | str | None" = MEMORY_AUTO
    # optimiser state per parameter element in training: AdamW keeps two fp32 values
    optimizer_state_bytes: int = 8
    # microbatches whose activations a rank holds at once: the memory budget counts each
    # activation this many times. The pipeline planner sets it for each stage's plan (all
    # microbatches under GPipe, at most the stages from this one on under 1F1B); 1 otherwise
    activations_in_flight: int = 1
    # backward passes whose data-parallel gradients one bucketed all-reduce reduces
    # (autopar/runtime/buckets.py): until the n-th, each rank sums its own gradients, and the
    # n-th reduces the sum (DDP's no_sync for n - 1 backwards). The pipeline sets each
    # stage's to its microbatches (one reduction per step, as torch's pipelining does with
    # DDP); the solver prices those reductions once per n backwards. 1 otherwise
    grad_sync_every: int = 1
    # collectives start as early as their input exists and are waited on just before
    # their result is used, with independent compute between (passes/lower/schedule.py); their
    # backward conjugates likewise. False: every step runs whole where the rewrite put it
    overlap: bool = True
    # bytes of collectives in flight at once on a rank (a start waits for older ones
    # beyond it); bounds the memory that prefetched gathers hold
    max_inflight_bytes: int = INFLIGHT_CAP_BYTES
    # run each rank's program through torch.compile (Inductor), collectives inside the
    # compiled graph; falls back to eager with one warning where Inductor cannot run
    compile: bool = False
    # keyword arguments for torch.compile (fullgraph=True is the default), e.g. {"mode": "max-autotune"}
    compile_options: Optional[dict] = None
    # replay each rank's program as CUDA graphs, collectives inside: compile with
    # torch.compile's mode="reduce-overhead" (CUDA graph trees). One graph records one
    # shape, so dynamic= is refused; so is a rank on a device other than CUDA
    cuda_graphs: bool = False
    # mixed precision, as FSDP2's MixedPrecisionPolicy: compute on copies of the floating
    # parameters and inputs in this dtype (e.g. torch.bfloat16) while the optimiser updates
    # the full-precision shards; outputs come back in the parameters' dtype. None: as is
    param_dtype: Optional[torch.dtype] = None
    # dtype gradient reductions run in (the data-parallel buckets and the backward of
    # reshard steps); None: the gradient's own dtype
    reduce_dtype: Optional[torch.dtype] = None
    # symbolic batch and sequence sizes (autopar/core/dynamic.py): one trace and one plan
    # serve every size in a range. True: wide default ranges, priced at the sizes of the
    # call that plans; Dynamic(batch=(lo, hi), seq=(lo, hi), plan_at=(b, s)): explicit.
    # Held as a Dynamic, or None for static shapes
    dynamic: Optional[Dynamic] = None
    # pipeline parallelism (autopar/core/pipeline.py, passes/plan/pipeline.py): the mesh axis whose
    # coordinate is the stage, PipelineAxis.AUTO ("auto": the planner decides whether and
    # on which axis pipelining pays), or None (no pipeline)
    pipeline_axis: "int | PipelineAxis | None" = None
    # microbatches per step when pipelining; they split dim 0 of every tensor input
    microbatches: int = 1
    # pipeline schedule (autopar.Schedule): "gpipe", "1f1b" or "interleaved_1f1b"
    pipeline_schedule: Schedule = Schedule.ONE_F_ONE_B
    # outputs left split as the plan makes them (passes/strategies/output_layouts.py): the
    # solver may return each output in any layout without partial sums, and an output that
    # comes back split is a DTensor on the plan's mesh (whole ones stay plain tensors).
    # False: every output is gathered whole on every rank
    sharded_outputs: bool = False

    def __post_init__(self) -> None:
        if self.pipeline_axis is not None and self.dynamic:  # as the caller spelled them
            raise PipelineError(f"pipeline_axis={self.pipeline_axis!r} with dynamic={self.dynamic!r}: pipelined "
                                "plans are made for one batch and sequence size; drop one of the two")
        self._normalise()
        self._check_numbers()
        self._check_cuda_graphs()
        self._check_sharded_outputs()
        link_overrides(self.links)  # likewise
        if not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes < 1:
            raise OptionsError(f"Options.nodes={self.nodes!r} is not a positive int; pass the number of machines "
                               "the ranks run on (with torchrun: its --nnodes), 1 for one machine")
        for field_name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field_name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise OptionsError(f"Options.{field_name}={dtype!r} is not a floating-point torch dtype; use "
                                   "torch.bfloat16, torch.float16 or torch.float32 (or None)")

    def _normalise(self) -> None:
        """Strings naming a mode become its enum (the keyword shortcuts stay as they were)."""
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)
        cost = self.cost_model
        if isinstance(cost, str) and cost not in {m.value for m in CostSource}:
            # a path: the older spelling
            if self.profile_path is not None:
                raise OptionsError(f"Options.cost_model={cost!r} is neither a cost source nor usable as a profile "
                                   f"path beside profile_path={self.profile_path!r}; pass cost_model='saved', "
                                   "profile_path=<file>")
            warnings.warn(f"Options(cost_model={cost!r}): a profile's file goes in profile_path; read as "
                          "cost_model='saved', profile_path=that file", DeprecationWarning, stacklevel=4)
            put("profile_path", cost)
            cost = CostSource.SAVED
        put("cost_model", CostSource.of_option(cost, "Options.cost_model"))
        clustering = {True: "inner", False: "off", None: "off"}.get(self.cluster_layers, self.cluster_layers) \
            if isinstance(self.cluster_layers, (bool, type(None))) else self.cluster_layers
        put("cluster_layers", Clustering.of_option(clustering, "Options.cluster_layers", extra=" (or True / False)"))
        put("solver", SolverChoice.of_option(self.solver, "Options.solver"))
        put("dynamic", Dynamic.of(self.dynamic))  # a clear OptionsError for anything else
        put("pipeline_schedule", Schedule.of(self.pipeline_schedule))
        if isinstance(self.pipeline_axis, str):
            put("pipeline_axis", PipelineAxis.of_option(self.pipeline_axis, "Options.pipeline_axis",
                                                         extra=" or a mesh axis number"))
        elif self.pipeline_axis is not None and not _is_int(self.pipeline_axis, 0):
            raise PipelineError(f"pipeline_axis={self.pipeline_axis!r} is not a mesh axis number; give an axis "
                                "number, 'auto' (the planner decides) or None")

    def _check_numbers(self) -> None:
        for name, low in (("optimizer_state_bytes", 0), ("max_inflight_bytes", 1), ("activations_in_flight", 1),
                          ("grad_sync_every", 1)):
            if not _is_int(getattr(self, name), low):
                raise OptionsError(f"Options.{name}={getattr(self, name)!r} is not an int >= {low}")
        if isinstance(self.mip_gap, bool) or not isinstance(self.mip_gap, (int, float)) or not 0 <= self.mip_gap < 1:
            raise OptionsError(f"Options.mip_gap={self.mip_gap!r} is not a fraction in [0, 1) (the relative gap "
                               "at which the solver stops, e.g. 1e-4)")
        if self.memory_budget_bytes not in (None, MEMORY_AUTO) and not _is_int(self.memory_budget_bytes, 1):
            raise OptionsError(f"Options.memory_budget_bytes={self.memory_budget_bytes!r} is not a positive int "
                               f"(bytes per rank), None for no bound, or {MEMORY_AUTO!r} (the detected device's "
                               "memory less headroom)")
        for name in ("profile_budget_s", "time_limit_s", "collective_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise OptionsError(f"Options.{name}={value!r} is not a positive number of seconds")
        for name in ("follow", "discover_rules", "overlap", "compile", "cuda_graphs", "sharded_outputs"):
            if not isinstance(getattr(self, name), bool):
                raise OptionsError(f"Options.{name}={getattr(self, name)!r} is not a bool (True or False)")
        if self.training is not None and not isinstance(self.training, bool):
            raise OptionsError(f"Options.training={self.training!r} is not True, False or None (the model's mode)")

    def _check_cuda_graphs(self) -> None:
        """cuda_graphs=True is compile=True with mode="reduce-overhead"; either spelling
        is refused with dynamic shapes."""
        if self.compile_options is not None and not isinstance(self.compile_options, dict):
            raise OptionsError(f"Options.compile_options={self.compile_options!r} is not a dict of torch.compile "
                               "keyword arguments")
        mode = (self.compile_options or {}).get("mode")
        if self.cuda_graphs:
            if mode not in (None, CUDA_GRAPHS_MODE):
                raise OptionsError(f"Options(cuda_graphs=True) compiles with mode={CUDA_GRAPHS_MODE!r}, but "
                                   f"compile_options asks for mode={mode!r}; drop one of the two")
            object.__setattr__(self, "compile", True)
            object.__setattr__(self, "compile_options", {**(self.compile_options or {}), "mode": CUDA_GRAPHS_MODE})
        if self.compile and (self.compile_options or {}).get("mode") == CUDA_GRAPHS_MODE and self.dynamic:
            raise OptionsError(f"CUDA graphs (cuda_graphs=True, torch.compile mode={CUDA_GRAPHS_MODE!r}) replay "
                               f"one recorded shape, and dynamic={self.dynamic!r} plans for a range of them; drop "
                               "one of the two (or pad the inputs to one shape)")

    def _check_sharded_outputs(self) -> None:
        if not self.sharded_outputs:
            return
        if self.pipeline_axis is not None:
            raise OptionsError(f"Options(sharded_outputs=True) with pipeline_axis={self.pipeline_axis!r}: a "
                               "pipeline's outputs come back through torch's schedule on the last stage, whole; "
                               "drop one of the two")
        if self.dynamic:
            raise OptionsError(f"Options(sharded_outputs=True) with dynamic={self.dynamic!r}: a split output's "
                               "DTensor needs the global shape of one call; plan for static shapes or drop "
                               "sharded_outputs")

    @property
    def planning(self) -> "PlanningOptions":
        """What shapes the plan: its search space, prices and solve."""
        return PlanningOptions(**{f.name: getattr(self, f.name) for f in fields(PlanningOptions)})

    @property
    def running(self) -> "RunningOptions":
        """How the ranks run a plan."""
        return RunningOptions(**{f.name: getattr(self, f.name) for f in fields(RunningOptions)})


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass(frozen=True)
class PlanningOptions:
    device: str
    nodes: int
    links: Optional[dict]
    cost_model: CostSource
    profile_path: Optional[str]
    profile_budget_s: float
    training: Optional[bool]
    follow: bool
    cluster_layers: Clustering
    discover_rules: bool
    solver: SolverChoice
    time_limit_s: float
    mip_gap: float
    memory_budget_bytes: "int | str | None"
    optimizer_state_bytes: int
    activations_in_flight: int
    grad_sync_every: int
    param_dtype: Optional[torch.dtype]
    dynamic: Optional[Dynamic]
    pipeline_axis: "int | PipelineAxis | None"
    microbatches: int
    pipeline_schedule: Schedule
    sharded_outputs: bool


@dataclass(frozen=True)
class RunningOptions:
    collective_timeout_s: float
    overlap: bool
    max_inflight_bytes: int
    compile: bool
    compile_options: Optional[dict]
    cuda_graphs: bool
    reduce_dtype: Optional[torch.dtype]
