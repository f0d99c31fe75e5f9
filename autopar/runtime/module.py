"""ParallelModule: runs the per-rank program on a torch DeviceMesh.

Every rank passes the same full inputs; each takes its own block locally (no
communication), runs its program, and gets full outputs back. Parameters live as
this rank's shards (nn.Parameters under `.shards`), so optimisers work unchanged.
Without example inputs the model is traced and planned at the first call, and again
for every new input signature (shapes, dtypes, non-tensor values); later plans keep
the parameter layouts of the first, so the shards stay valid across signatures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from autopar import _compat
from autopar.runtime.collectives import AxisComm, step_runner
from autopar.passes.program import bind
from autopar.runtime.buckets import GradBuckets
from autopar.core.errors import InputMismatchError, MeshError, ProcessGroupError
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.placement import Placement
from autopar.core.plan import Plan
from autopar.runtime.state import ShardedStateMethods
from autopar.passes.planning import plan_traced, trace_for_planning
from autopar.cost_models.profile import Profile
from autopar.runtime.measure import default_profile_path, profile_compute, profile_for_mesh, samples_of, save_profile
from autopar.passes.strategies import annotate
from autopar.passes.emit import RankProgram, emit, shard
from autopar.passes.trace import TracedGraph, flatten_inputs


@dataclass(frozen=True)
class _Compiled:
    traced: TracedGraph
    plan: Plan
    program: RankProgram
    buckets: GradBuckets  # this program's data-parallel gradient all-reduces


def _signature(tensors: list[torch.Tensor], spec: Any, consts: tuple) -> tuple:
    return (str(spec), repr(consts), tuple((tuple(t.shape), t.dtype) for t in tensors))


class ParallelModule(ShardedStateMethods, nn.Module):
    def __init__(self, model: nn.Module, mesh: Mesh, options: Options, plan: "Plan | str | None" = None,
                 materialize_on: "torch.device | str | None" = None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise ProcessGroupError(
                "autopar.compile needs an initialised process group: launch with torchrun "
                "(torchrun --nproc-per-node N script.py) and call torch.distributed.init_process_group(), "
                "or use autopar.plan(...) to plan offline without processes")
        world = dist.get_world_size()
        if world != mesh.size:
            raise MeshError(f"mesh {mesh.shape} has {mesh.size} devices but the process group has {world} ranks; "
                            f"pick a mesh whose sizes multiply to {world}")
        devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
        if len(devices) > 1:
            raise MeshError(f"model {type(model).__name__} has parameters on several devices {sorted(map(str, devices))}; "
                            "move it to one device (model.to(device)) before compiling")
        self.device = next(iter(devices)) if devices else torch.device("cpu")
        # a model on the meta device is planned without weights; each rank then reads only
        # its own shards (load_safetensors, load_full_state_dict, load_checkpoint)
        self.on_meta = self.device.type == "meta"
        if self.on_meta:
            self.device = torch.device(materialize_on or "cpu")
        self.mesh = mesh
        self.options = options
        self.rank = dist.get_rank()
        self.coords = mesh.coords(self.rank)
        self._comms = self._axis_comms(mesh)
        self.__dict__["_model"] = model  # not a submodule: its full parameters are not ours
        self.shards = nn.Module()
        self._register_empty_shards(model)
        self._active_buckets: Optional[GradBuckets] = None
        self._compiled: dict[tuple, _Compiled] = {}
        self._pinned: Optional[dict[str, tuple[Placement, ...]]] = None
        self._last: Optional[_Compiled] = None
        self._given_plan, self._plan_source = _load_given(plan)
        self._state_specs: dict[str, Any] = {}  # state-dict name -> Spec of its shard
        self._loaded = not self.on_meta  # a meta model's shards are filled by a load

    def _register_empty_shards(self, model: nn.Module) -> None:
        """Every parameter exists from the start (empty until the first plan fills it),
        so an optimiser can be built before the first call; tied names share one."""
        made: dict[int, Any] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(torch.empty(0, dtype=p.dtype, device=self.device),
                                           requires_grad=p.requires_grad)
                if p.requires_grad:
                    made[id(p)].register_post_accumulate_grad_hook(self._accumulated)
            _set_nested(self.shards, name, made[id(p)], parameter=True)
        for name, b in model.named_buffers(remove_duplicate=False):
            if id(b) not in made:
                made[id(b)] = torch.empty(0, dtype=b.dtype, device=self.device)
            _set_nested(self.shards, name, made[id(b)], parameter=False)

    def _accumulated(self, param: torch.Tensor) -> None:
        if self._active_buckets is not None:
            self._active_buckets.accumulated(param)

    def _axis_comms(self, mesh: Mesh) -> tuple[AxisComm, ...]:
        """One process group per mesh axis (with the collective timeout), wrapped in a
        torch DeviceMesh (`self.device_mesh`) for DTensor and checkpoint interop."""
        comms, groups = [], []
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        for axis, size in enumerate(mesh.shape):
            group = None
            # every rank must create every group, in the same order
            for first in range(mesh.size):
                ranks = mesh.axis_ranks(first, axis)
                if ranks[0] != first:
                    continue
                g = dist.new_group(list(ranks), backend=backend, timeout=_timedelta(self.options.collective_timeout_s))
                if self.rank in ranks:
                    group = g
            groups.append(group)
            comms.append(AxisComm(group, size, self.coords[axis]))
        from torch.distributed.device_mesh import DeviceMesh
        self.device_mesh = DeviceMesh.from_group(groups, self.device.type,
                                                 mesh=torch.arange(mesh.size).view(mesh.shape),
                                                 mesh_dim_names=tuple(f"axis{a}" for a in range(mesh.ndim)))
        return tuple(comms)

    # ---- planning -------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise RuntimeError("no plan yet: the module is planned at its first call (or pass example inputs "
                               "to autopar.compile to plan eagerly)")
        return self._last.plan

    @property
    def code(self) -> str:
        """The Python source of this rank's program, with its collectives visible."""
        if self._last is None:
            raise RuntimeError("no program yet: call the module once, or compile with example inputs")
        return self._last.program.code

    def prepare(self, args: tuple = (), kwargs: Optional[dict] = None) -> Plan:
        """Trace and plan for these inputs now (what the first call would do)."""
        tensors, spec, consts = flatten_inputs(args, kwargs or {})
        return self._get(args, kwargs or {}, _signature(tensors, spec, consts)).plan

    def _get(self, args: tuple, kwargs: dict, key: tuple) -> _Compiled:
        if key in self._compiled:
            return self._compiled[key]
        # a failure on any rank (trace, plan, plan file) reaches every rank at the agreement
        # check below, so no rank is left waiting in a collective
        traced, plan, problem = None, None, None
        try:
            traced = trace_for_planning(self._model, args, kwargs)
        except Exception as e:  # noqa: BLE001
            problem = e
        if self._given_plan is None:
            profile = self._profile() if problem is None else None
            plan, problem = self._plan_on_rank0(traced, problem, profile)
        elif problem is None:
            try:
                plan = self._given(traced)
            except Exception as e:  # noqa: BLE001
                problem = e
        self._check_plan_agreement(plan, problem)
        program = emit(traced, plan, self.coords, self.device, defer_grad_sync=True)
        bind(program.gm, step_runner(self._comms))
        if self._pinned is None:
            self._materialise_state(traced, plan)
        targets = {gi.name: gi.target for gi in traced.inputs}
        deferred = program.gm.meta.get("autopar.deferred_grad_syncs", ())
        buckets = GradBuckets([(targets[n], _get_nested(self.shards, targets[n]), axes) for n, axes in deferred],
                              self._comms)
        compiled = _Compiled(traced, plan, program, buckets)
        self._compiled[key] = compiled
        return compiled

    def _given(self, traced: TracedGraph) -> Plan:
        from autopar.core.errors import PlanFileError
        plan = self._given_plan
        if plan.fingerprint != traced.fingerprint:
            raise PlanFileError(
                f"{self._plan_source} was made for {plan.model_name} with graph fingerprint {plan.fingerprint}, "
                f"but {traced.model_name} with these inputs traces to {traced.fingerprint}; re-plan for this "
                "model and these input shapes")
        if plan.mesh != self.mesh:
            raise PlanFileError(f"{self._plan_source} is for mesh {plan.mesh.shape}, not {self.mesh.shape}")
        return plan

    def _check_plan_agreement(self, plan: Optional[Plan], problem: Optional[Exception]) -> None:
        """Every rank compares the hash of its plan and reshard schedule before the first
        step, and reports any local failure to plan: a mismatch or an error anywhere
        fails on every rank with a message, instead of leaving the others in a collective."""
        mine = (plan.digest() if plan is not None else None, f"{type(problem).__name__}: {problem}" if problem else None)
        seen: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, mine)
        failed = [(r, err) for r, (_, err) in enumerate(seen) if err]
        if problem is not None:
            raise problem
        if failed:
            r, err = failed[0]
            raise ProcessGroupError(f"rank {r} could not plan ({err}); this rank stops too")
        digests = [d for d, _ in seen]
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise ProcessGroupError(
                f"ranks run different plans: rank 0 has plan {digests[0]}, ranks {odd} have "
                f"{sorted(set(digests[r] for r in odd))}; give every rank the same model, inputs and plan file")

    def _profile(self) -> Optional[Profile]:
        """Options.cost_model == "profile": the cached profile of this machine, with the
        mesh's links calibrated now if it lacks them (every rank takes part)."""
        if self.options.cost_model != "profile":
            return None
        self._profile_path = self.options.profile_path or default_profile_path(self.device)
        return profile_for_mesh(self._profile_path, self.mesh, self._comms, self.device)

    def _plan_on_rank0(self, traced: Optional[TracedGraph], problem: Optional[Exception],
                       profile: Optional[Profile] = None) -> tuple[Optional[Plan], Optional[Exception]]:
        """Rank 0 solves; the others receive its plan (one solve instead of one per
        rank, and every rank is sure to run the same plan). Returns (plan, problem)."""
        box: list[Any] = [problem]
        if self.rank == 0 and problem is None:
            try:
                if profile is not None:  # measure what this graph's strategies would run, then keep it
                    import os
                    graph = annotate(traced, self.mesh, self._pinned, self.options.discover_rules)
                    profile_compute(samples_of(graph, self.mesh.shape), profile, self.device,
                                    self.options.profile_budget_s)
                    save_profile(profile, self._profile_path)
                box[0] = plan_traced(traced, self.mesh, self.options, self._pinned, profile)[1]
            except Exception as e:  # noqa: BLE001 - forwarded so the other ranks fail too, not hang
                box[0] = e
        dist.broadcast_object_list(box, src=0)
        if problem is not None:
            return None, problem
        if isinstance(box[0], Exception):
            if self.rank == 0:
                return None, box[0]
            return None, RuntimeError(f"planning failed on rank 0: {type(box[0]).__name__}: {box[0]}")
        plan = box[0]
        if plan.fingerprint != traced.fingerprint:
            return None, InputMismatchError(
                f"rank {self.rank} traced a different graph (fingerprint {traced.fingerprint}) than rank 0 "
                f"({plan.fingerprint}); every rank must pass the same model and input shapes")
        return plan, None

    def _materialise_state(self, traced: TracedGraph, plan: Plan) -> None:
        """Cut this rank's shards from the full model. Tied parameters (one tensor under
        several names) become one shard registered under every name, in the layout of
        the name the graph actually reads."""
        named = dict(self._model.named_parameters(remove_duplicate=False))
        named.update(self._model.named_buffers(remove_duplicate=False))
        used = {e.producer for e in plan.edges}
        state_inputs = [gi for gi in traced.inputs if gi.kind in ("parameter", "buffer")]
        ties: dict[int, list] = {}
        for gi in state_inputs:
            ties.setdefault(id(named[gi.target]), []).append(gi)
        pinned = {}
        for group in ties.values():
            owner = next((gi for gi in group if gi.name in used), group[0])
            spec = plan.node(owner.name).outputs[0]
            full = named[owner.target]
            if not self.on_meta:  # on meta the shard stays empty until a load fills it
                holder = _get_nested(self.shards, owner.target)  # registered empty at compile time
                with torch.no_grad():
                    holder.data = shard(full.detach(), spec, self.mesh.shape, self.coords)
            for gi in group:
                pinned[gi.target] = spec.placements
                self._state_specs[gi.target] = spec
        self._pinned = pinned

    # ---- running ----------------------------------------------------------------
    def forward(self, *args: Any, local_inputs: bool = False, **kwargs: Any) -> Any:
        """Run one step. By default every rank passes the same full inputs; with
        local_inputs=True each rank passes only its own block of every input (as
        `input_specs` / `shard_inputs` describe), e.g. from a data loader that reads just
        that part. Local inputs need an existing plan for their global shapes."""
        tensors, spec, consts = flatten_inputs(args, kwargs)
        for i, t in enumerate(tensors):
            if t.device != self.device:
                raise InputMismatchError(f"input tensor #{i} (shape {tuple(t.shape)}) is on {t.device} but the model "
                                         f"is on {self.device}; move inputs to the model's device")
        if local_inputs:
            compiled = self._compiled_for_local(tensors, spec, consts)
            local = self._local_inputs(compiled, tensors, already_local=True)
        else:
            compiled = self._get(args, kwargs, _signature(tensors, spec, consts))
            local = self._local_inputs(compiled, tensors)
        if self.on_meta and not self._loaded:
            raise RuntimeError("the model was compiled on the meta device and its shards are not loaded yet: call "
                               "pm.load_safetensors(path), pm.load_full_state_dict(sd) or pm.load_checkpoint(path)")
        self._last = compiled
        if torch.is_grad_enabled():  # this step's backward reduces this program's buckets
            compiled.buckets.arm()
            self._active_buckets = compiled.buckets
        outputs = compiled.program.gm(*local)
        return _compat.tree_unflatten(_compat.tree_flatten(outputs)[0], compiled.traced.out_spec)

    def _compiled_for_local(self, tensors: list[torch.Tensor], spec: Any, consts: tuple) -> _Compiled:
        shapes = tuple((tuple(t.shape), t.dtype) for t in tensors)
        for key, compiled in self._compiled.items():
            if key[:2] != (str(spec), repr(consts)):
                continue
            specs = self._user_specs(compiled)
            if tuple((s.local_shape(self.mesh.shape), s.meta.dtype) for s in specs) == shapes:
                return compiled
        raise InputMismatchError(
            f"no plan takes local inputs of shapes {[s for s, _ in shapes]} on rank {self.rank}: call the module once "
            "with full inputs (or compile with example inputs) so the global shapes are known, then pass each "
            "rank's block as pm.shard_inputs(...) gives it")

    def _user_specs(self, compiled: _Compiled) -> list:
        pairs = [(gi.target, s) for gi, s in zip(compiled.program.inputs, compiled.program.specs)
                 if gi.kind == "user_input"]
        return [s for _, s in sorted(pairs, key=lambda p: p[0])]

    @property
    def input_specs(self) -> dict[str, Any]:
        """How each tensor input of the current plan is split: {'kwargs['input_ids']': Spec}."""
        if self._last is None and not self._compiled:
            raise RuntimeError("no plan yet: call the module once or compile with example inputs")
        compiled = self._last or next(iter(self._compiled.values()))
        paths = compiled.traced.input_paths
        return {paths[i]: s for i, s in enumerate(self._user_specs(compiled))}

    def shard_inputs(self, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """This rank's block of full inputs, in the same structure: what
        pm(..., local_inputs=True) expects."""
        tensors, spec, consts = flatten_inputs(args, kwargs)
        compiled = self._get(args, kwargs, _signature(tensors, spec, consts))
        specs = self._user_specs(compiled)
        leaves, tree = _compat.tree_flatten((tuple(args), dict(kwargs)))
        it = iter(specs)
        out = [shard(x, next(it), self.mesh.shape, self.coords) if isinstance(x, torch.Tensor) else x for x in leaves]
        return _compat.tree_unflatten(out, tree)

    def _local_inputs(self, compiled: _Compiled, tensors: list[torch.Tensor],
                      already_local: bool = False) -> list[torch.Tensor]:
        """This rank's block of every program input, in placeholder order."""
        program = compiled.program
        local = []
        for gi, s in zip(program.inputs, program.specs):
            if gi.kind in ("parameter", "buffer"):
                local.append(_get_nested(self.shards, gi.target))
            elif gi.kind == "constant":
                local.append(shard(compiled.traced.constants[gi.target], s, self.mesh.shape, self.coords))
            else:
                t = tensors[gi.target]
                local.append(t if already_local or s.is_replicated() else shard(t, s, self.mesh.shape, self.coords))
        return local


def _load_given(plan: "Plan | str | None") -> tuple[Optional[Plan], str]:
    if plan is None or isinstance(plan, Plan):
        return plan, "the given plan"
    import os
    return Plan.from_json(plan), f"plan file {os.fspath(plan)}"


def _timedelta(seconds: float):
    from datetime import timedelta
    return timedelta(seconds=seconds)


def _set_nested(root: nn.Module, dotted: str, value: Any, parameter: bool) -> None:
    *path, leaf = dotted.split(".")
    mod = root
    for p in path:
        if not hasattr(mod, p) or not isinstance(getattr(mod, p), nn.Module):
            mod.add_module(p, nn.Module())
        mod = getattr(mod, p)
    if parameter:
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)


def _get_nested(root: nn.Module, dotted: str) -> Any:
    obj: Any = root
    for p in dotted.split("."):
        obj = getattr(obj, p)
    return obj
