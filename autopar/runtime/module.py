"""ParallelModule: the one executor; it runs any Plan on this rank.

Every rank passes the same full inputs; each takes its own block locally (no communication),
runs its program, and gets the outputs back (whole, or DTensors where the plan leaves them
split: outputs.py). Parameters live as this rank's shards (nn.Parameters under `.shards`).
Without example inputs the model is traced and planned at the first call, and again
for every new input signature (shapes, dtypes, non-tensor values); later plans keep
the parameter layouts of the first, so the shards stay valid across signatures. A
pipelined plan runs as this rank's stages instead (stages.py); pm.step(...) trains one
step of either (step.py).

A coordinator over small parts: groups.py (process groups per mesh axis), shipping.py (rank 0
traces, the others rebuild its graph), call_agreement.py (every call's inputs the same on
every rank before any collective), agree.py (rank 0 plans, every rank agrees), programs.py
(the one signature -> program cache), shards.py (this rank's parameters), measure.py and
measured_plan.py (the profiling cost model), buckets.py (data-parallel gradient
all-reduce), state.py and checkpoint_view.py (clipping, state dicts, checkpoints) and
passes/lower/emit.py (the program, its inputs, the blocks of its buffers' new values).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from autopar import _compat
from autopar.core.dynamic import Dynamic
from autopar.core.errors import InputMismatchError, MeshError
from autopar.core.kinds import NodeKind
from autopar.core.mesh import Mesh
from autopar.core.options import CostSource, Options
from autopar.core.pipeline import PipelineError
from autopar.core.placement import Placement, Spec
from autopar.core.plan import Plan
from autopar.core.plan_book import PlanBook, given_plans
from autopar.passes.plan.buffer_layouts import LocalBuffers
from autopar.passes.plan.planner import plan_graph
from autopar.passes.lower.emit import RankProgram, buffer_blocks, emit, local_inputs, shard
from autopar.passes.plan.planning import plan_annotated
from autopar.passes.plan.state_layouts import pinned_layouts
from autopar.passes.lower.program import bind
from autopar.passes.strategies.strategies import AnnotatedGraph
from autopar.passes.trace.trace import TracedGraph, flatten_inputs
from autopar.runtime.buckets import GradBuckets
from autopar.runtime.call_agreement import CallSignature, PendingAgreement, start_agreement
from autopar.runtime.collectives import settled_before_first_collective
from autopar.runtime.step_runner import step_runner
from autopar.runtime.compiling import compiled_program
from autopar.passes.plan.dynamic_plans import PlannedSignature
from autopar.runtime.programs import ProgramCache
from autopar.runtime.groups import MeshGroups, mesh_groups
from autopar.runtime.checkpoint_view import CheckpointView, ShardView
from autopar.runtime.measure import default_profile_path, profile_for_mesh
from autopar.runtime.measured_plan import measured_plan
from autopar.runtime.metrics import StepMetrics, step_meter
from autopar.runtime.outputs import caller_outputs
from autopar.runtime.agree import agreed_plan, attempt
from autopar.runtime.shipping import shared_trace
from autopar.runtime.step import Stages, one_program_step
from autopar.runtime.shards import empty_shards, fill_shards, store_buffers
from autopar.runtime.state import ShardedStateMethods


@dataclass(frozen=True)
class Compiled:
    """One input signature's trace, plan and program on this rank."""

    traced: TracedGraph
    plan: Plan
    program: RankProgram
    buckets: GradBuckets  # this program's data-parallel gradient all-reduces
    run: Callable[..., Any]  # the program itself, or the program under torch.compile


class ParallelModule(ShardedStateMethods, nn.Module):
    """Runs any Plan on this rank: one program per input signature, or, for a pipelined
    plan, this rank's stages under torch's schedule (`stages`). pm.step(*args,
    target=..., **kwargs) trains one step whichever it is."""

    def __init__(self, model: nn.Module, mesh: Mesh, options: Options, plan: "Plan | PlanBook | str | None" = None,
                 materialize_on: "torch.device | str | None" = None, seeds: tuple[Plan, ...] = (),
                 local_buffers: Optional[LocalBuffers] = None, groups: Optional[MeshGroups] = None,
                 loss_fn: Optional[Callable[..., torch.Tensor]] = None, stages: Optional[Stages] = None) -> None:
        """`local_buffers`: buffers (a KV cache) whose layout is chosen among candidate
        splits by solving once per candidate, each rank then keeping its block of their
        updates without communication (passes/plan/buffer_layouts.py). `groups`: the groups of
        a sub-mesh (a pipeline stage's, groups.stage_groups); default: the whole world. `seeds`:
        plans rank 0 made already (mesh="auto"'s), used for their graphs instead of a solve.
        `loss_fn(output, target)`: what step() minimises. `stages`: a pipelined plan's."""
        super().__init__()
        self.mesh, self.options, self.stages = mesh, options, stages
        self.__dict__["loss_fn"] = loss_fn  # not a submodule even when it is an nn.Module
        self.device, self.on_meta = _model_device(model, materialize_on)
        if stages is not None:  # the stages hold the shards, groups and programs
            self.stage_modules = nn.ModuleList(stages.modules())
            groups = MeshGroups(mesh, dist.get_rank(), (), None, None)
        groups = groups or mesh_groups(mesh, self.device, options.collective_timeout_s)
        self.group = groups.group  # the ranks that trace and plan together (None: the world)
        self.span = groups.span  # the same ranks over gloo, under Options.collective_timeout_s
        self.rank, self.coords, self.comms, self.device_mesh = groups.rank, groups.coords, groups.comms, groups.device_mesh
        self.__dict__["source_model"] = model  # not a submodule: its full parameters are not ours
        self.shards, self.state_tensors = ((nn.Module(), {}) if stages is not None
                                           else empty_shards(model, self.device, _BucketsOf(self)))
        self.state_specs: dict[str, Spec] = {}  # state-dict name -> Spec of its shard
        compile_ref = weakref.WeakMethod(self._compile)  # the cache does not keep the module alive
        self.programs = ProgramCache(Dynamic.of(options.dynamic), lambda *a, **kw: compile_ref()(*a, **kw))
        self.current: Optional[Compiled] = None  # the program of the last call (or of compile's inputs)
        self.loaded = not self.on_meta  # a meta model's shards are filled by a load
        self._pinned: Optional[dict[str, tuple[Placement, ...]]] = None  # layouts later plans keep
        self._armed: Optional[GradBuckets] = None  # the buckets the running backward fills
        self._given, self._given_source = given_plans(plan)
        self._seeds = {p.fingerprint: p for p in seeds}
        self.local_buffers = local_buffers
        super().train(model.training)  # pm.training says what the model is traced in
        self.trace_count = 0  # traces this rank took part in (rank 0 traces, the others load its graph)
        self.solve_count = 0 if stages is None else stages.solve_count  # ILP solves this rank ran (rank 0's)
        self.calls = 0  # forward calls, numbered in the error when the ranks' inputs differ
        self.agreed_calls = 0  # calls whose inputs this module agreed between the ranks itself
        self._caller_agrees = False  # inside agreed_by_caller()
        self._world = dist.get_world_size(self.span) if dist.is_initialized() else 1
        self.meter = step_meter(model, options, self.device, self._world)

    def train(self, mode: bool = True) -> "ParallelModule":
        """Training or evaluation mode, for this module and the model it runs: a mode
        traces its own graph (dropout, BatchNorm's statistics), so each keeps its own
        programs (parameter layouts pinned by the first, as for any new signature)."""
        super().train(mode)
        self.source_model.train(mode)
        return self

    @property
    def plan(self) -> Plan:
        return self.stages.plan if self.stages is not None else self._require_current().plan

    @property
    def last_step(self) -> Optional[StepMetrics]:
        """The last finished step's time, tokens/s per device, MFU and peak memory (None
        until the second call: a step ends as the next starts; autopar/runtime/metrics.py)."""
        if self.stages is not None:
            raise PipelineError("per-step metrics are measured for plans of one program, not pipelines yet")
        return self.meter.last

    @property
    def plan_book(self) -> PlanBook:
        """Every plan this module has run or prepared, one per traced graph, in the order
        they were made: saved with .to_json(path), `compile(..., plan=path)` runs all of
        those calls without solving."""
        if self.stages is not None:
            return PlanBook.of([self.stages.plan])
        return PlanBook.of([c.plan for c in self.programs.all()])

    @property
    def code(self) -> str:
        """The Python source of this rank's program, with its collectives visible."""
        return self._require_current().program.code

    def prepare(self, args: tuple = (), kwargs: Optional[dict] = None) -> Plan:
        """Trace and plan for these inputs now (what the first call would do)."""
        self.current = self._compiled(args, kwargs or {})
        return self.current.plan

    def forward(self, *args: Any, local_inputs: bool = False, **kwargs: Any) -> Any:
        """Run one step. By default every rank passes the same full inputs; with
        local_inputs=True each rank passes only its own block of every input (as
        `input_specs` / `shard_inputs` describe). Local inputs need an existing plan."""
        if self.stages is not None:
            raise PipelineError("a pipelined plan runs its microbatches through torch's schedule: train with "
                                "pm.step(*args, target=..., **kwargs), not pm(...)")
        self.meter.start()
        tensors, spec, consts = flatten_inputs(args, kwargs)
        compiled, agreement = self._agreed_call(args, kwargs, tensors, spec, consts, local_inputs)
        with settled_before_first_collective(agreement.settle if agreement is not None else None):
            if not self.loaded:
                raise RuntimeError("the model was compiled on the meta device and its shards are not loaded yet: call "
                                   "pm.load_safetensors(path), pm.load_full_state_dict(sd) or pm.load_checkpoint(path)")
            self.current = compiled
            self.meter.begin(compiled.plan, compiled.traced, tensors, local_inputs,
                             compiled.plan.training and torch.is_grad_enabled())
            if torch.is_grad_enabled():  # this step's backward reduces this program's buckets
                compiled.buckets.arm()
                self._armed = compiled.buckets
            feed = self._feed(compiled, tensors, user_is_local=local_inputs)
            outputs = compiled.run(*feed)
        store_buffers(self.state_tensors, buffer_blocks(compiled.program, compiled.traced, compiled.plan, outputs,
                                                        self.mesh.shape))
        return caller_outputs(outputs, compiled.traced, compiled.plan, self.device_mesh)

    def step(self, *args: Any, target: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
        """One training step, whatever the plan: forward, loss_fn(output, target), backward;
        gradients are left in pm.parameters(). loss_fn sees the output as torch's pipeline
        gives it to the last stage (its tensor leaves; the one tensor when there is one).
        Returns the loss (a pipeline's mean over microbatches, on the last stage's ranks,
        None on the others)."""
        if self.loss_fn is None:
            raise PipelineError("pm.step(...) needs the loss: autopar.compile(model, ..., loss_fn=fn) with "
                                "fn(output, target) -> loss")
        if self.stages is not None:
            return self.stages.step(*args, target=target, **kwargs)
        return one_program_step(self, self.loss_fn, args, kwargs, target)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer gathered whole (on every rank), under the original
        model's state-dict names: loadable with model.load_state_dict. Every rank calls it."""
        return self.stages.full_state_dict() if self.stages is not None else super().full_state_dict()

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """This rank's block of each full tensor into its shards (keys: the model's names)."""
        if self.stages is not None:
            return self.stages.load_full_state_dict(state_dict)
        super().load_full_state_dict(state_dict)

    def _require_own_shards(self, what: str) -> None:
        if self.stages is not None:
            raise PipelineError(f"pm.{what} does not take a pipelined plan yet (its shards live in the stages, "
                                "pm.stages.modules()); use pm.full_state_dict() / pm.load_full_state_dict(sd), or "
                                "save_training_checkpoint / resume")

    def checkpoint_view(self) -> CheckpointView:
        """What save_training_checkpoint / load_training_checkpoint read and write here."""
        return self.stages.checkpoint_view() if self.stages is not None else ShardView(self)

    @property
    def input_specs(self) -> dict[str, Spec]:
        """How each tensor input of the current plan is split: {"kwargs['input_ids']": Spec}."""
        compiled = self._require_current()
        return dict(zip(compiled.traced.input_paths, _user_specs(compiled)))

    def shard_inputs(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """This rank's block of full inputs, in the same structure: what
        pm(..., local_inputs=True) expects."""
        compiled = self._compiled(args, kwargs)
        leaves, tree = _compat.tree_flatten((tuple(args), dict(kwargs)))
        specs = iter(_user_specs(compiled))
        return _compat.tree_unflatten([shard(x, next(specs), self.mesh.shape, self.coords) if isinstance(x, torch.Tensor) else x
                                       for x in leaves], tree)

    @contextlib.contextmanager
    def agreed_by_caller(self) -> Iterator[None]:
        """Calls inside skip the per-call agreement, for a caller whose every call's inputs
        follow from what the ranks have already agreed (generation's decode steps follow
        from its agreed request): one all-reduce less per call. A rank that passes other
        inputs inside sends the ranks into different collectives."""
        before, self._caller_agrees = self._caller_agrees, True
        try:
            yield
        finally:
            self._caller_agrees = before

    # ---- parts ----------------------------------------------------------------------
    def _agreed_call(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor], spec: Any, consts: tuple,
                     local_inputs: bool) -> tuple[Compiled, Optional[PendingAgreement]]:
        """This call's program and its agreement (call_agreement), left under way where it can be."""
        self.calls += 1
        problem = attempt(lambda: _check_devices(tensors, self.device))[1]
        compiled = pending = None
        if local_inputs and problem is None:  # blocks differ by rank: agree on the program they feed
            compiled, problem = attempt(lambda: self._compiled_for_local(tensors, spec, consts))
        elif problem is None:
            compiled = self.programs.cached(tensors, spec, consts, self.source_model.training)
        if self._world > 1 and not self._caller_agrees:
            fed = compiled.traced.fingerprint if local_inputs and problem is None else None
            now = problem is not None or compiled is None or self.options.compile  # compiled code skips _ops
            pending = start_agreement(CallSignature.of_call(args, kwargs, self.source_model.training, problem, fed),
                                      self.calls, self.span, settle_now=now)
            self.agreed_calls += 1
        if problem is not None:
            raise problem
        return (compiled if compiled is not None else self._compiled(args, kwargs)), pending

    def _require_current(self) -> Compiled:
        if self.stages is not None:
            raise PipelineError("a pipelined plan has a program per stage: read them as pm.stages.modules()")
        if self.current is None:
            raise RuntimeError("no plan yet: the module is planned at its first call (or pass example inputs "
                               "to autopar.compile to plan eagerly)")
        return self.current

    def _feed(self, compiled: Compiled, tensors: list[torch.Tensor], user_is_local: bool) -> list[torch.Tensor]:
        return local_inputs(compiled.program, self.state_tensors, compiled.traced.constants, tensors,
                            self.mesh.shape, state_is_local=True, user_is_local=user_is_local)

    @property
    def plans(self) -> list[PlannedSignature]:
        """The input signatures planned so far, in order (dynamic: with dims, ranges, priced-at sizes)."""
        return self.programs.signatures()

    def _compiled(self, args: tuple, kwargs: dict) -> Compiled:
        if self.stages is not None:
            raise PipelineError("a pipelined plan's stages were prepared when it was compiled; it has no program "
                                "of its own to prepare or shard inputs for: train with pm.step(...)")
        return self.programs.compiled(args, kwargs, self.source_model.training)

    def _compile(self, args: tuple, kwargs: dict, dynamic_shapes: Optional[tuple] = None) -> Compiled:
        """Trace (with torch.export Dims where `dynamic_shapes` gives them) and plan."""
        self.trace_count += 1
        traced, problem = shared_trace(self.source_model, args, kwargs, self.options.param_dtype, self.device,
                                       dynamic_shapes, self.group)
        profile = self._profile() if self._given is None and problem is None else None
        user = flatten_inputs(args, kwargs)[0] if dynamic_shapes is None else None  # to time the program
        plan = agreed_plan(traced, problem, lambda t: self._solve(t, profile, user), self._given, self._given_source,
                            self.group)
        opts = self.options.running  # how this rank runs the plan
        program = emit(traced, plan, self.coords, self.device, defer_grad_sync=True,
                       inflight_cap_bytes=opts.max_inflight_bytes if opts.overlap else None)
        bind(program.gm, step_runner(self.comms, overlap=opts.overlap and not opts.compile,
                                     reduce_dtype=opts.reduce_dtype))
        if self._pinned is None:
            self.state_specs = fill_shards(self.source_model, self.state_tensors, traced, plan, self.coords,
                                           self.on_meta)
            self._pinned = pinned_layouts(self.state_specs)
        deferred = program.deferred_grad_syncs
        targets = {gi.name: gi.target for gi in traced.inputs}
        buckets = GradBuckets([(targets[n], self.state_tensors[targets[n]], axes) for n, axes in deferred], self.comms,
                              opts.reduce_dtype, self.options.grad_sync_every)
        run = compiled_program(program.gm, self.device, opts.compile_options) if opts.compile else program.gm
        return Compiled(traced, plan, program, buckets, run)

    def _profile(self):
        """cost_model "profile": this machine's profile, its links calibrated now if missing (all ranks)."""
        if self.options.cost_model is not CostSource.PROFILE:
            return None
        return profile_for_mesh(self._profile_path(), self.mesh, self.comms, self.device, self.options.nodes)

    def _profile_path(self) -> str:
        return self.options.profile_path or default_profile_path(self.device)

    def _solve(self, traced: TracedGraph, profile, user: Optional[list[torch.Tensor]] = None) -> Plan:
        """Rank 0's solve; with a profile, the ops the strategies would run are timed first
        (the program timed whole only without local buffers, whose plans are chosen among
        several)."""
        if traced.fingerprint in self._seeds:  # mesh="auto" planned this graph already
            return self._seeds[traced.fingerprint]
        self.solve_count += 1
        timed = None if self.local_buffers is not None else user
        return plan_graph(traced, self.mesh, self.options, self._pinned, self.local_buffers,
                          lambda graph: self._solve_graph(graph, profile, timed))

    def _solve_graph(self, graph: AnnotatedGraph, profile, user: Optional[list[torch.Tensor]] = None) -> Plan:
        """With a profile, measured first (runtime/measured_plan.py)."""
        if profile is None:
            return plan_annotated(graph, self.options, profile)
        return measured_plan(graph, self.options, profile, self.device, None if self.on_meta else self.source_model,
                             user, self._profile_path())

    def _compiled_for_local(self, tensors: list[torch.Tensor], spec: Any, consts: tuple) -> Compiled:
        found = self.programs.for_local(
            tensors, spec, consts, self.source_model.training, self.mesh.shape, _user_specs,
            lambda c: tuple((s.local_shape_at(self.mesh.shape, self.coords), s.meta.dtype) for s in _user_specs(c)))
        if found is not None:
            return found
        raise InputMismatchError(
            f"no plan takes local inputs of shapes {[tuple(t.shape) for t in tensors]} on rank {self.rank}: call the "
            "module once with full inputs (or compile with example inputs) so the global shapes are known, then pass "
            "each rank's block as pm.shard_inputs(...) gives it")


class _BucketsOf:
    """The gradient hook's weak way to the armed buckets (the hooks live on pm's parameters)."""

    def __init__(self, pm: ParallelModule) -> None:
        self.pm = weakref.ref(pm)

    def __call__(self, param: torch.Tensor, grad: torch.Tensor) -> Optional[torch.Tensor]:
        pm = self.pm()
        if pm is not None and pm._armed is not None:
            return pm._armed.gradient(param, grad)
        return None


def _user_specs(compiled: Compiled) -> list[Spec]:
    """The Spec of each user tensor leaf, in leaf order."""
    pairs = [(gi.target, s) for gi, s in zip(compiled.program.inputs, compiled.program.specs)
             if gi.kind is NodeKind.USER_INPUT]
    return [s for _, s in sorted(pairs, key=lambda p: p[0])]


def _model_device(model: nn.Module, materialize_on: "torch.device | str | None") -> tuple[torch.device, bool]:
    """Where this rank runs, and whether the model is on meta (planned without weights;
    each rank then reads only its own shards onto `materialize_on`)."""
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        raise MeshError(f"model {type(model).__name__} has parameters on several devices {sorted(map(str, devices))}; "
                        "move it to one device (model.to(device)) before compiling")
    device = next(iter(devices)) if devices else torch.device("cpu")
    if device.type == "meta":
        return torch.device(materialize_on or "cpu"), True
    return device, False


def _check_devices(tensors: list[torch.Tensor], device: torch.device) -> None:
    for i, t in enumerate(tensors):
        if t.device != device:
            raise InputMismatchError(f"input tensor #{i} (shape {tuple(t.shape)}) is on {t.device} but the model "
                                     f"is on {device}; move inputs to the model's device")
