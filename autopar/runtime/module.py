"""ParallelModule: runs the per-rank program on the mesh's process groups.

Every rank passes the same full inputs; each takes its own block locally (no
communication), runs its program, and gets full outputs back. Parameters live as
this rank's shards (nn.Parameters under `.shards`), so optimisers work unchanged.
Without example inputs the model is traced and planned at the first call, and again
for every new input signature (shapes, dtypes, non-tensor values); later plans keep
the parameter layouts of the first, so the shards stay valid across signatures.

A coordinator over small parts: groups.py (process groups per mesh axis), shipping.py
(rank 0 traces, the others rebuild its graph), call_agreement.py (every call's inputs
the same on every rank before any collective), planner.py (rank 0 plans, every rank
agrees), shards.py (this rank's parameters), measure.py (the profiling cost model),
buckets.py (data-parallel gradient all-reduce), state.py (clipping, state dicts,
checkpoints) and passes/emit.py (the program, its inputs, and the blocks of the
buffers it writes, which shards.store_buffers keeps after each call).
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
from autopar.core.options import Options
from autopar.core.placement import Placement, Spec
from autopar.core.plan import Plan
from autopar.core.plan_book import PlanBook, given_plans
from autopar.passes.buffer_layouts import LocalBuffers, plan_local_buffers
from autopar.passes.emit import RankProgram, buffer_blocks, emit, local_inputs, shard
from autopar.passes.planning import plan_annotated
from autopar.passes.program import bind
from autopar.passes.strategies import AnnotatedGraph, annotate
from autopar.passes.trace import TracedGraph, flatten_inputs
from autopar.runtime.buckets import GradBuckets
from autopar.runtime.call_agreement import CallSignature, agree_on_call
from autopar.runtime.step_runner import step_runner
from autopar.runtime.compiling import compiled_program
from autopar.runtime.dynamic_programs import DynamicPrograms, PlannedSignature
from autopar.runtime.groups import MeshGroups, mesh_groups
from autopar.runtime.measure import (calibrate_program, default_profile_path, profile_compute, profile_for_mesh,
                                     samples_of, save_profile)
from autopar.runtime.planner import agreed_plan, attempt
from autopar.runtime.shipping import Inputs, shared_trace
from autopar.runtime.shards import empty_shards, fill_shards, pinned_layouts, store_buffers, whole_state
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
    def __init__(self, model: nn.Module, mesh: Mesh, options: Options, plan: "Plan | PlanBook | str | None" = None,
                 materialize_on: "torch.device | str | None" = None,
                 local_buffers: Optional[LocalBuffers] = None, groups: Optional[MeshGroups] = None) -> None:
        """`local_buffers`: buffers (a KV cache) whose layout is chosen among candidate
        splits by solving once per candidate, each rank then keeping its block of their
        updates without communication (passes/buffer_layouts.py). `groups`: the groups of
        a sub-mesh (a pipeline stage's, groups.stage_groups); default: the whole world."""
        super().__init__()
        self.mesh, self.options = mesh, options
        self.device, self.on_meta = _model_device(model, materialize_on)
        groups = groups or mesh_groups(mesh, self.device, options.collective_timeout_s)
        self.group = groups.group  # the ranks that trace and plan together (None: the world)
        self.span = groups.span  # the same ranks over gloo, under Options.collective_timeout_s
        self.rank, self.coords, self.comms, self.device_mesh = groups.rank, groups.coords, groups.comms, groups.device_mesh
        self.__dict__["source_model"] = model  # not a submodule: its full parameters are not ours
        self.shards, self.state_tensors = empty_shards(model, self.device, _BucketsOf(self))
        self.state_specs: dict[str, Spec] = {}  # state-dict name -> Spec of its shard
        self.programs: dict[tuple, Compiled] = {}  # input signature -> its program
        self.current: Optional[Compiled] = None  # the program of the last call (or of compile's inputs)
        self.loaded = not self.on_meta  # a meta model's shards are filled by a load
        self._pinned: Optional[dict[str, tuple[Placement, ...]]] = None  # layouts later plans keep
        self._armed: Optional[GradBuckets] = None  # the buckets the running backward fills
        self._given, self._given_source = given_plans(plan)
        self.local_buffers = local_buffers
        self._dynamic = Dynamic.of(options.dynamic)
        self._dynamic_programs: dict[bool, DynamicPrograms] = {}  # the source model's mode -> its programs
        super().train(model.training)  # pm.training says what the model is traced in
        self.trace_count = 0  # traces this rank took part in (rank 0 traces, the others load its graph)
        self.solve_count = 0  # ILP solves this rank ran (rank 0 solves for every rank)
        self.calls = 0  # forward calls, numbered in the error when the ranks' inputs differ
        self.agreed_calls = 0  # calls whose inputs this module agreed between the ranks itself
        self._caller_agrees = False  # inside agreed_by_caller()
        self._world = dist.get_world_size(self.span) if dist.is_initialized() else 1

    def train(self, mode: bool = True) -> "ParallelModule":
        """Training or evaluation mode, for this module and the model it runs: a mode
        traces its own graph (dropout, BatchNorm's statistics), so each keeps its own
        programs (parameter layouts pinned by the first, as for any new signature)."""
        super().train(mode)
        self.source_model.train(mode)
        return self

    @property
    def dynamic(self) -> Optional[DynamicPrograms]:
        """Options.dynamic's programs for the model's current mode (None without it)."""
        if self._dynamic is None:
            return None
        mode = self.source_model.training
        if mode not in self._dynamic_programs:
            self._dynamic_programs[mode] = DynamicPrograms(self._dynamic, self._compile)
        return self._dynamic_programs[mode]

    @property
    def plan(self) -> Plan:
        return self._require_current().plan

    @property
    def plan_book(self) -> PlanBook:
        """Every plan this module has run or prepared, one per traced graph, in the order
        they were made: saved with .to_json(path), `compile(..., plan=path)` runs all of
        those calls without solving."""
        compiled = list(self.programs.values()) + [c for programs in self._dynamic_programs.values()
                                                   for c in programs.compiled_programs()]
        return PlanBook.of([c.plan for c in compiled])

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
        tensors, spec, consts = flatten_inputs(args, kwargs)
        compiled = self._agreed_call(args, kwargs, tensors, spec, consts, local_inputs)
        if not self.loaded:
            raise RuntimeError("the model was compiled on the meta device and its shards are not loaded yet: call "
                               "pm.load_safetensors(path), pm.load_full_state_dict(sd) or pm.load_checkpoint(path)")
        self.current = compiled
        if torch.is_grad_enabled():  # this step's backward reduces this program's buckets
            compiled.buckets.arm()
            self._armed = compiled.buckets
        feed = self._feed(compiled, tensors, user_is_local=local_inputs)
        outputs = compiled.run(*feed)
        store_buffers(self.state_tensors, buffer_blocks(compiled.program, compiled.traced, compiled.plan, outputs,
                                                        self.mesh.shape))
        return _compat.tree_unflatten(compiled.traced.user_outputs(outputs), compiled.traced.out_spec)

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
        from its agreed request): one all-gather less per call. A rank that passes other
        inputs inside sends the ranks into different collectives."""
        before, self._caller_agrees = self._caller_agrees, True
        try:
            yield
        finally:
            self._caller_agrees = before

    # ---- parts ----------------------------------------------------------------------
    def _agreed_call(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor], spec: Any, consts: tuple,
                     local_inputs: bool) -> Compiled:
        """This call's program, once every rank has shown the same inputs (call_agreement):
        a rank whose inputs are refused here shows its error instead, so every rank stops."""
        self.calls += 1
        problem = attempt(lambda: _check_devices(tensors, self.device))[1]
        compiled = None
        if local_inputs and problem is None:  # blocks differ by rank: agree on the program they feed
            compiled, problem = attempt(lambda: self._compiled_for_local(tensors, spec, consts))
        if self._world > 1 and not self._caller_agrees:
            if problem is not None:
                inputs: Any = f"inputs refused here ({type(problem).__name__}: {problem})"
            else:
                inputs = ("local inputs of", compiled.traced.fingerprint) if local_inputs else Inputs.of(args, kwargs)
            agree_on_call(CallSignature(inputs, self.source_model.training, torch.is_grad_enabled()), self.calls,
                          self.span)
            self.agreed_calls += 1
        if problem is not None:
            raise problem
        return compiled if local_inputs else self._compiled(args, kwargs)

    def _require_current(self) -> Compiled:
        if self.current is None:
            raise RuntimeError("no plan yet: the module is planned at its first call (or pass example inputs "
                               "to autopar.compile to plan eagerly)")
        return self.current

    def _feed(self, compiled: Compiled, tensors: list[torch.Tensor], user_is_local: bool) -> list[torch.Tensor]:
        return local_inputs(compiled.program, self.state_tensors, compiled.traced.constants, tensors,
                            self.mesh.shape, state_is_local=True, user_is_local=user_is_local)

    @property
    def plans(self) -> list[PlannedSignature]:
        """The input signatures planned so far, in order (with Options.dynamic, each with
        its symbolic dims, their ranges and the sizes the plan was priced at)."""
        static = [PlannedSignature(tuple((p, s, dtype) for p, (s, dtype) in zip(c.traced.input_paths, key[2])))
                  for key, c in self.programs.items()]
        return static + [p for programs in self._dynamic_programs.values() for p in programs.plans]

    def _compiled(self, args: tuple, kwargs: dict) -> Compiled:
        if self.dynamic is not None:
            return self.dynamic.compiled(args, kwargs)
        tensors, spec, consts = flatten_inputs(args, kwargs)
        key = _signature(tensors, spec, consts) + (self.source_model.training,)
        if key not in self.programs:
            self.programs[key] = self._compile(args, kwargs)
        return self.programs[key]

    def _compile(self, args: tuple, kwargs: dict, dynamic_shapes: Optional[tuple] = None) -> Compiled:
        """Trace (with torch.export Dims where `dynamic_shapes` gives them) and plan."""
        self.trace_count += 1
        traced, problem = shared_trace(self.source_model, args, kwargs, self.options.param_dtype, self.device,
                                       dynamic_shapes, self.group)
        profile = self._profile() if self._given is None and problem is None else None
        user = flatten_inputs(args, kwargs)[0] if dynamic_shapes is None else None  # to time the program
        plan = agreed_plan(traced, problem, lambda t: self._solve(t, profile, user), self._given, self._given_source,
                            self.group)
        opts = self.options
        program = emit(traced, plan, self.coords, self.device, defer_grad_sync=True,
                       inflight_cap_bytes=opts.max_inflight_bytes if opts.overlap else None)
        bind(program.gm, step_runner(self.comms, overlap=opts.overlap and not opts.compile,
                                     reduce_dtype=opts.reduce_dtype))
        if self._pinned is None:
            self.state_specs = fill_shards(self.source_model, self.state_tensors, traced, plan, self.coords,
                                           self.on_meta)
            self._pinned = pinned_layouts(self.state_specs)
        deferred = program.gm.meta.get("autopar.deferred_grad_syncs", ())
        targets = {gi.name: gi.target for gi in traced.inputs}
        buckets = GradBuckets([(targets[n], self.state_tensors[targets[n]], axes) for n, axes in deferred], self.comms,
                              opts.reduce_dtype)
        run = compiled_program(program.gm, self.device, opts.compile_options) if opts.compile else program.gm
        return Compiled(traced, plan, program, buckets, run)

    def _profile(self):
        """Options.cost_model == "profile": this machine's cached profile, with the mesh's
        links calibrated now if it lacks them (every rank takes part)."""
        if self.options.cost_model != "profile":
            return None
        return profile_for_mesh(self._profile_path(), self.mesh, self.comms, self.device, self.options.nodes)

    def _profile_path(self) -> str:
        return self.options.profile_path or default_profile_path(self.device)

    def _solve(self, traced: TracedGraph, profile, user: Optional[list[torch.Tensor]] = None) -> Plan:
        """Rank 0's solve; with a profile, the ops the strategies would run are timed first."""
        self.solve_count += 1
        if self.local_buffers is not None:
            return plan_local_buffers(traced, self.mesh, self.options, self._pinned, self.local_buffers,
                                      lambda graph: self._solve_graph(graph, profile))
        return self._solve_graph(annotate(traced, self.mesh, self._pinned, self.options.discover_rules), profile, user)

    def _solve_graph(self, graph: AnnotatedGraph, profile, user: Optional[list[torch.Tensor]] = None) -> Plan:
        """With a profile: the strategies' ops timed first, and the first plan's program
        timed whole (with `user`, the inputs, on a model with weights), then planned
        again with what that says of ops inside a program (Profile.program_factor)."""
        if profile is None:
            return plan_annotated(graph, self.options, profile)
        training = graph.traced.training if self.options.training is None else self.options.training
        profile_compute(samples_of(graph, self.mesh.shape), profile, self.device, self.options.profile_budget_s,
                        backward=training)
        plan = plan_annotated(graph, self.options, profile)
        if user is not None and not self.on_meta and calibrate_program(
                graph.traced, plan, profile, self.device, whole_state(self.source_model), user, training,
                self.options.profile_budget_s):
            plan = plan_annotated(graph, self.options, profile)
        save_profile(profile, self._profile_path())
        return plan

    def _compiled_for_local(self, tensors: list[torch.Tensor], spec: Any, consts: tuple) -> Compiled:
        if self.dynamic is not None:
            found = self.dynamic.for_local(tensors, (str(spec), repr(consts)), self.mesh.shape, _user_specs)
            if found is not None:
                return found
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors)
        for key, compiled in self.programs.items():
            if key[:2] == (str(spec), repr(consts)) and key[3] == self.source_model.training and shapes == tuple(
                    (s.local_shape_at(self.mesh.shape, self.coords), s.meta.dtype) for s in _user_specs(compiled)):
                return compiled
        raise InputMismatchError(
            f"no plan takes local inputs of shapes {[s for s, _ in shapes]} on rank {self.rank}: call the module once "
            "with full inputs (or compile with example inputs) so the global shapes are known, then pass each "
            "rank's block as pm.shard_inputs(...) gives it")


class _BucketsOf:
    """The gradient hook's way to the module's armed buckets (a weak reference: the hooks
    live on the module's own parameters)."""

    def __init__(self, pm: ParallelModule) -> None:
        self.pm = weakref.ref(pm)

    def __call__(self, param: torch.Tensor, grad: torch.Tensor) -> Optional[torch.Tensor]:
        pm = self.pm()
        if pm is not None and pm._armed is not None:
            return pm._armed.gradient(param, grad)
        return None


def _signature(tensors: list[torch.Tensor], spec: Any, consts: tuple) -> tuple:
    return (str(spec), repr(consts), tuple((tuple(t.shape), t.dtype) for t in tensors))


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
