"""The public entry points: compile (run on a mesh) and plan (offline)."""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from autopar.core.errors import MeshError, ProcessGroupError
from autopar.core.mesh import Mesh, check_node_layout
from autopar.core.options import Options, OptionsError
from autopar.core.pipeline import PipelineError
from autopar.core.placement import R, Spec, TensorMeta, parse_placements
from autopar.core.plan import Plan
from autopar.core.plan_book import PlanBook, given_plans
from autopar.passes.plan import planner
from autopar.passes.plan.buffer_layouts import LocalBuffers
from autopar.passes.plan.mesh_choice import check_mesh_request, plan_mesh_choice
from autopar.passes.plan.planning import options_with
from autopar.runtime.agree import agreed
from autopar.runtime.generation import Generator
from autopar.runtime.groups import start_process_group
from autopar.runtime.kv_cache import CachedLM
from autopar.runtime.module import ParallelModule
from autopar.runtime.stages import PipelineStages, pipelined_plan
from autopar.runtime.resume import (CheckpointManifest, latest_checkpoint,  # noqa: F401 - re-exported
                                    load_training_checkpoint, resume, save_training_checkpoint)

AUTO_MESH = "auto"  # compile(mesh="auto") / plan(mesh="auto", devices=N): the planner chooses

__all__ = ["CheckpointManifest", "compile", "compile_for_generation", "latest_checkpoint", "load_training_checkpoint",
           "plan", "plan_for_generation", "resume", "save_training_checkpoint"]


def compile(model: nn.Module, args: Optional[tuple] = None, kwargs: Optional[dict] = None, *,
            mesh: Any, options: Optional[Options] = None, plan: Any = None,
            materialize_on: Any = None, loss_fn: Any = None,
            **option_overrides: Any) -> ParallelModule:
    """Parallelise `model` over `mesh` on the initialised process group.

    Without `args`/`kwargs` it is traced and planned at the first call (per input
    signature); with them, now. `plan` (a Plan, a PlanBook such as
    pm.plan_book, or a JSON path to either) skips solving: each call runs the plan made
    for its traced graph (found by graph fingerprint).
    A model on the meta device is planned without weights; its shards are then read
    per rank with pm.load_safetensors / load_full_state_dict / load_checkpoint onto
    `materialize_on` (default cpu). Keyword overrides go to Options (device=..., training=...).
    `nodes=N` says the ranks run on N machines (node-major, as torchrun numbers them): mesh
    axes inside a node are priced with the preset's intra-node link, the others with its
    inter-node one (`links=` overrides either); N must divide the world.
    `dynamic=True` (or autopar.Dynamic(batch=(lo, hi), seq=(lo, hi), plan_at=(b, s))) traces
    batch and sequence dims as symbolic: one trace and one plan serve every size in the
    range (autopar/core/dynamic.py; pm.plans lists what was planned).
    `pipeline_axis=` (an axis or "auto"), `microbatches=`, `pipeline_schedule=`: the
    planner may choose a pipeline, whose stages run under torch.distributed.pipelining
    (autopar/runtime/stages.py); it needs example inputs and `loss_fn(output, target)`.
    `loss_fn` given, pm.step(*args, target=..., **kwargs) trains one step whatever the plan.
    mesh="auto" (with example inputs): rank 0 plans every 1-, 2- and 3-axis mesh of the
    world's ranks and all run the cheapest (plan.explain_mesh() lists them).
    mesh=fn (a function of the world size, e.g. lambda world: (world // 2, 2)): the mesh
    fn returns for the process group's size, so one script runs on whatever world
    torchrun's elastic agent gives it (resume() then reshards the checkpoint onto it).
    """
    opts = _device_of(model, options_with(options, option_overrides), materialize_on)
    if callable(mesh):
        mesh = _mesh_of_world(mesh)
    seeds: tuple[Plan, ...] = ()  # mesh="auto": rank 0's plan of these inputs, further signatures solved
    if isinstance(mesh, str) and mesh == AUTO_MESH:
        chosen = _mesh_chosen_on_rank0(model, args, kwargs, opts, plan)
        seeds, mesh = (chosen,), chosen.mesh
    book = given_plans(plan)[0]
    piped = next((p for p in (book.plans if book is not None else ()) if p.pipeline is not None), None)
    if opts.pipeline_axis is not None or piped is not None:  # a given pipelined plan runs as one
        return _pipelined(model, args, kwargs, Mesh.of(mesh), opts, piped or (book.plans[0] if book else None),
                          loss_fn)
    check_launch_layout(Mesh.of(mesh), opts.nodes)
    pm = ParallelModule(model, Mesh.of(mesh), opts, plan, materialize_on, seeds, loss_fn=loss_fn)
    if args is not None or kwargs is not None:
        if args is not None and not isinstance(args, (tuple, list)):
            args = (args,)
        pm.prepare(tuple(args or ()), kwargs or {})
    return pm


def _pipelined(model: nn.Module, args: Any, kwargs: Optional[dict], mesh: Mesh, opts: Options,
               given: Optional[Plan], loss_fn: Any) -> ParallelModule:
    """`given`: a plan to run (a pipelined one sets the pipeline options it was made with)."""
    if given is not None and given.pipeline is not None and opts.pipeline_axis is None:
        p = given.pipeline
        opts = replace(opts, pipeline_axis=p.axis, microbatches=p.microbatches, pipeline_schedule=p.schedule)
    if loss_fn is None or (args is None and kwargs is None):
        raise PipelineError(f"pipeline_axis={opts.pipeline_axis!r} needs example inputs and a loss: "
                            "autopar.compile(model, args, kwargs, mesh=..., pipeline_axis=..., loss_fn=fn) with "
                            "fn(output, target) -> loss (the schedule runs it on the last stage)")
    check_launch_layout(mesh, opts.nodes)
    args = tuple(args) if isinstance(args, (tuple, list)) else (() if args is None else (args,))
    kwargs = dict(kwargs or {})
    chosen = pipelined_plan(model, args, kwargs, mesh, opts, given)
    if chosen.pipeline is None:  # pipeline_axis="auto" found that pipelining does not pay
        pm = ParallelModule(model, mesh, replace(opts, pipeline_axis=None), chosen, loss_fn=loss_fn)
        pm.prepare(args, kwargs)
        return pm
    stages = PipelineStages(model, args, kwargs, mesh, opts, loss_fn, chosen,
                            planned_here=given is None and dist.get_rank() == 0)
    return ParallelModule(model, mesh, opts, loss_fn=loss_fn, stages=stages)


def plan(model: nn.Module, args: Any = (), kwargs: Optional[dict] = None, *, mesh: Any = (1,),
         devices: Optional[int] = None, options: Optional[Options] = None, **option_overrides: Any) -> Plan:
    """Plan `model` for `mesh` offline (no process group): the Plan autopar.compile
    would run. Keyword overrides go to Options (e.g. device="h100", training=True). With
    `dynamic=`, the trace and plan compile would make for these inputs' range (the same
    graph fingerprint, so compile(..., plan=that plan, dynamic=the same) runs it).
    mesh="auto" with `devices=N`: the cheapest of N devices' 1-, 2- and 3-axis meshes
    (passes/plan/mesh_choice.py; plan.explain_mesh() lists what was tried)."""
    opts = options_with(options, option_overrides)
    if isinstance(mesh, str) and mesh == AUTO_MESH:
        if devices is None:
            raise MeshError("mesh='auto' offline needs the device count: autopar.plan(..., mesh='auto', devices=8)")
        return plan_mesh_choice(model, args, kwargs, devices, opts)
    if devices is not None:
        raise MeshError(f"devices={devices} goes with mesh='auto'; mesh {mesh!r} already says how many")
    return planner.plan_model(model, args, kwargs, Mesh.of(mesh), opts)


def _mesh_of_world(mesh_fn: Any) -> tuple[int, ...]:
    """compile(mesh=fn): fn(world size), checked to be a mesh shape of that many ranks."""
    world = _world_size("mesh=fn")
    shape = mesh_fn(world)
    ok = isinstance(shape, (tuple, list)) and shape and all(type(s) is int and s >= 1 for s in shape)
    if not ok or math.prod(shape) != world:
        raise MeshError(f"mesh={getattr(mesh_fn, '__name__', mesh_fn)} returned {shape!r} for a world of {world} "
                        f"ranks; it must return a tuple of positive ints whose product is {world}")
    return tuple(shape)


def _world_size(asked: str) -> int:
    """The process group's size (started under torchrun where none exists yet)."""
    start_process_group()
    if not (dist.is_available() and dist.is_initialized()):
        raise ProcessGroupError(f"{asked} needs the process group to count the ranks: run under torchrun "
                                "(python -m autopar run) or call torch.distributed.init_process_group first")
    return dist.get_world_size()


def _mesh_chosen_on_rank0(model: nn.Module, args: Any, kwargs: Optional[dict], opts: Options, given: Any) -> Plan:
    """compile(mesh="auto"): rank 0 plans every mesh of the world's ranks for these
    inputs and every rank takes its choice (agree.agreed)."""
    if given is not None:
        raise MeshError("mesh='auto' chooses the mesh by planning: with plan= given, pass that plan's mesh")
    if args is None and kwargs is None:
        raise MeshError("mesh='auto' plans at compile time: pass example inputs, "
                        "autopar.compile(model, args, kwargs, mesh='auto')")
    world = _world_size("mesh='auto'")
    args = args if isinstance(args, (tuple, list)) or args is None else (args,)
    check_mesh_request(opts)  # before anything is traced
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    check_node_layout(Mesh((world,)), opts.nodes, world, int(local) if local.isdigit() else None)
    return agreed(lambda: plan_mesh_choice(model, tuple(args or ()), kwargs or {}, world, opts))


def _device_of(model: nn.Module, opts: Options, materialize_on: Any = None) -> Options:
    """device="auto" for a model that runs on the CPU is the CPU preset, whatever GPU the
    host has (a gloo job on a GPU machine is not priced as the GPU, nor bounded by its
    memory); so is a meta model whose shards are made on the CPU (materialize_on's
    default); on CUDA, the accelerator's (cost_models/devices.py detected_device)."""
    kinds = {t.device.type for t in [*model.parameters(), *model.buffers()]}
    if "meta" in kinds:
        kinds = (kinds - {"meta"}) | {torch.device(materialize_on or "cpu").type}
    if opts.device == "auto" and kinds and kinds <= {"cpu"}:
        return replace(opts, device="cpu")
    return opts


def check_launch_layout(mesh: Mesh, nodes: int) -> None:
    """Before any collective: `mesh` on `nodes` nodes (Options.nodes) fits the running
    process group, and, under torchrun, its ranks per node (LOCAL_WORLD_SIZE) too, so a
    wrong node count fails on every rank with a MeshError naming it, not a mispriced plan.
    Under torchrun without a process group, one is started first (groups.start_process_group)."""
    start_process_group()
    if not (dist.is_available() and dist.is_initialized()):
        return  # the runtime's own check says how to start a process group
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    check_node_layout(mesh, nodes, dist.get_world_size(), int(local) if local.isdigit() else None)


def compile_for_generation(model: nn.Module, *, mesh: Any, max_batch: int = 1, max_cache_len: int = 256,
                           prefill_len: Optional[int] = None, cache_layout: Optional[str] = None,
                           plan: Any = None, options: Optional[Options] = None, **option_overrides: Any) -> Generator:
    """A Generator for the causal LM `model` over `mesh`: gen.generate(input_ids,
    max_new_tokens, do_sample=..., temperature=..., top_k=..., generator=...).

    The model runs with a static KV cache of `max_batch` rows and `max_cache_len`
    positions, held as buffers of one ParallelModule with two plans (decode, planned
    first, and prefill over `prefill_len` positions, default max_cache_len). The solver
    chooses the cache's layout among splits by batch and by KV heads (or replicated);
    `cache_layout` (one placement per mesh axis, e.g. "RS(1)") fixes it instead.
    Both plans are made now, every rank taking part; then the wrapper's full cache is
    dropped (each rank keeps only its block). `plan`: a plan book (gen.plan_book, or its
    file from .to_json) of the same model, mesh and sizes: neither plan is solved again.
    """
    opts = _device_of(model, _generation_options(options, option_overrides))
    mesh_ = Mesh.of(mesh)
    check_launch_layout(mesh_, opts.nodes)
    cached = CachedLM(model.eval(), max_batch, max_cache_len)
    layout = _cache_layout(cache_layout, cached, mesh_)
    pm = ParallelModule(cached, mesh_, opts, plan, local_buffers=LocalBuffers(tuple(cached.cache_names()), (0, 1),
                                                                             layout))
    gen = Generator(pm, cached.shape, max_cache_len if prefill_len is None else prefill_len)
    gen.prepare()
    cached.release_cache()  # every rank holds its block now; both plans are made
    return gen


def plan_for_generation(model: nn.Module, *, mesh: Any, max_batch: int = 1, max_cache_len: int = 256,
                        prefill_len: Optional[int] = None, cache_layout: Optional[str] = None,
                        options: Optional[Options] = None, **option_overrides: Any) -> PlanBook:
    """Offline (no process group): the decode and prefill plans compile_for_generation
    would make with these arguments, as a book; `compile_for_generation(..., plan=book or
    its file)` then solves neither. Decode is planned first and prefill keeps its
    parameter and cache layouts, as on the ranks."""
    opts = _generation_options(options, option_overrides)
    mesh_ = Mesh.of(mesh)
    cached = CachedLM(model.eval(), max_batch, max_cache_len)
    local = LocalBuffers(tuple(cached.cache_names()), (0, 1), _cache_layout(cache_layout, cached, mesh_))
    steps = Generator(cached, cached.shape, max_cache_len if prefill_len is None else prefill_len).step_inputs()
    return planner.plan_steps(cached, steps, mesh_, opts, local)


def _generation_options(options: Optional[Options], overrides: dict) -> Options:
    opts = options_with(options, {"training": False, **overrides})
    if opts.sharded_outputs:
        raise OptionsError("generation with sharded_outputs=True: the generator picks each next token from the "
                           "logits whole on every rank; plan it without sharded_outputs")
    return opts


def _cache_layout(text: Optional[str], cached: CachedLM, mesh: Mesh) -> Any:
    if text is None:
        return None
    layout = parse_placements(text)
    meta = TensorMeta.of(cached.key_cache_0)
    idle = any(p != R and n == 1 for p, n in zip(layout, mesh.shape))
    if len(layout) != mesh.ndim or idle or not Spec(layout, meta).fits(mesh.shape):
        raise MeshError(f"cache_layout={text!r} does not split the cache (batch, kv_heads, length, head_dim) = "
                        f"{tuple(meta.shape)} evenly over mesh {mesh.shape}; give one placement per mesh axis "
                        "(R, S(0) for batch, S(1) for KV heads; R on an axis of size 1) whose splits divide those dims")
    return layout
