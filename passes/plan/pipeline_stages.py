"""Each stage of a pipelined plan as the ranks run it, and its own plan.

    model + one microbatch of inputs + PipelinePlan
        --torch's pipeline() split at the plan's block boundaries--> stage modules
        --relay (pipeline_relay.py), one microbatch through the split graph--> StageSplit
    StageSplit --each stage's module traced at its inputs, solved on the sub-mesh--> Plans

The planner stores those plans in Plan.stage_plans (passes/pipeline.plan_model), so a
saved pipelined plan is the whole contract: the runtime (runtime/stages.py) builds the
same StageSplit from its own copy of the model, gives each stage its plan, and no rank
solves. The split is deterministic (the model, the inputs and the block boundaries fix
it), so the stage graphs a rank traces have the fingerprints the plans were made for.

1. split_model: torch's pipeline() before each later stage's first block, the user's model
   left as it was.
2. split_stages: the stage modules (taken before relaying, which rewrites only the split
   graph), the relays, and what each stage module is called with for one microbatch;
   check_skips refuses what torch's schedules cannot run.
3. stage_inputs, own_inputs: what a stage is called with, and what its program is traced
   with (the first stage: the model's own inputs; a relaying stage: without the values it
   only passes on).
4. stage_plans: step 3's trace of every stage, planned on the sub-mesh. It splits a short
   model whose stage traces stretch to the whole model's (passes/plan/stage_sample.py)
   where the blocks allow; the runtime splits the whole model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from autopar.core.log import LOG, logged
from autopar.core.options import Options
from autopar.core.pipeline import PipelineError, PipelinePlan, Schedule, Stage, stage_mesh
from autopar.core.plan import Plan
from autopar.passes.plan.pipeline_relay import Relayed, relay_skips
from autopar.passes.plan.forked import map_forked
from autopar.passes.plan.planning import plan_traced, trace_for_planning
from autopar.passes.plan.stage_sample import NotStretched, StageSample, short_model, stage_graph, stage_sample
from autopar.passes.trace.trace import TracedGraph, cast_floating

Pins = Callable[[TracedGraph], dict]  # a stage's traced graph -> plan_traced's `pinned`


@dataclass(frozen=True)
class StageSplit:
    pipe: Any  # torch's Pipe: split_gm, get_stage_module(k), info()
    modules: tuple[nn.Module, ...]  # each stage's own module, in stage order
    relays: dict[int, Relayed]  # stage -> the values it passes on
    examples: tuple[tuple[tuple, dict], ...]  # per stage: what its module is called with (one microbatch)
    values: dict[str, Any]  # every value the split graph passes, by node name


def split_model(model: nn.Module, args: tuple, kwargs: dict, points: tuple[str, ...]) -> Any:
    """Step 1: torch's pipeline() split before each module path in `points`. pipeline()
    wraps the forward of those modules in place; they are unwrapped again, so the user's
    model is left as it was (and can be split again). torch.distributed.pipelining is
    imported here, not with this module: it brings torch._dynamo and DTensor along.
    The split's graph modules generate their code when first called, not at each of
    the split's ~10^3 graph edits (about a sixth of the 70B shape's split)."""
    from torch.distributed import pipelining as pp
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    split = {name: pp.SplitPoint.BEGINNING for name in points}
    try:
        with _use_lazy_graph_module(True):
            return pp.pipeline(model, mb_args=args, mb_kwargs=kwargs, split_spec=split)
    finally:
        for name in points:
            module = model.get_submodule(name)
            for attr in ("forward", "_orig_forward"):
                module.__dict__.pop(attr, None)


@logged("split", lambda split: f"{len(split.modules)} stage modules")
def split_stages(model: nn.Module, mb_args: tuple, mb_kwargs: dict, pipeline: PipelinePlan,
                 training: bool, param_dtype: Optional[torch.dtype] = None) -> StageSplit:
    """Step 2, for one microbatch of inputs. Under `param_dtype` (Options.param_dtype) the
    split is traced with the floating parameters and inputs in that dtype: the casts a
    model writes as .to(x.dtype) are recorded in the stage graphs as the dtype they run
    in (in fp32 they would cast bf16 activations back to fp32), and the values passed
    between stages are in that dtype too (runtime/stages.py StageModule sends them so).
    The parameters are the masters again after."""
    with computing_in(model, param_dtype) as cast:
        pipe = split_model(model, *cast((mb_args, mb_kwargs)), pipeline.split_points)
        modules = tuple(pipe.get_stage_module(k) for k in range(len(pipeline.stages)))  # before relaying
        interleaved = pipeline.schedule is Schedule.INTERLEAVED_1F1B
        relays = relay_skips(pipe.split_gm, lambda val: interleaved or (training and val.is_floating_point()))
        examples, values = _stage_examples(pipe, *cast((mb_args, mb_kwargs)))
    modules = tuple(_without_dtype_asserts(m) for m in modules)
    if param_dtype is not None:
        for m in modules:
            _as_masters(m, model)
    check_skips(pipe, values, training, pipeline.schedule)
    return StageSplit(pipe, modules, relays, tuple(examples), values)


@contextmanager
def computing_in(model: nn.Module, dtype: Optional[torch.dtype]) -> Iterator[Callable[[Any], Any]]:
    """The model's floating parameters in `dtype` for the duration (none changed without
    one), and a function casting the floating tensors of a tree likewise; the parameters'
    own tensors are put back after."""
    if dtype is None:
        yield lambda tree: tree
        return
    saved = [(p, p.data) for p in model.parameters() if p.is_floating_point()]
    try:
        with torch.no_grad():
            for p, data in saved:
                p.data = data.to(dtype)
        yield lambda tree: cast_floating(tree, dtype)
    finally:
        for p, data in saved:
            p.data = data


def _as_masters(module: nn.Module, model: nn.Module) -> None:
    """A stage module's parameters the model's masters again: torch's split shares most
    Parameter objects with the model (computing_in restored those), but holds copies of
    some (tied weights), made while cast; each such copy takes its master's value and
    dtype back, by name (the split keeps the model's names)."""
    masters = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, q in module.named_parameters(remove_duplicate=False):
            master = masters.get(name)
            if master is not None and q is not master and q.is_floating_point():
                q.data = master.detach().clone()


def _without_dtype_asserts(module: nn.Module) -> nn.Module:
    """A stage module without the metadata assertions torch's split records in its
    submodules' graphs (each checks a value's dtype as traced, fp32): under
    Options.param_dtype the stage computes in bf16 and they would fail. Erased in place
    (the split is the only user), each graph made runnable again."""
    for sub in module.modules():
        graph = getattr(sub, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        asserts = [n for n in graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default]
        for node in asserts:
            graph.erase_node(node)
        if asserts and isinstance(sub, torch.fx.GraphModule):
            sub.recompile()
        elif asserts and callable(getattr(sub, "finalize", None)):  # torch.export's InterpreterModule
            sub.finalize()
    return module


def stage_inputs(split: StageSplit, index: int, mb_args: tuple, mb_kwargs: dict) -> tuple[tuple, dict]:
    """Step 3: what stage `index` is called with for one microbatch. Stage 0 is called as
    the user calls the model (keywords stay keywords), with the keywords its module reads
    (a later stage reads the labels; the loss takes the target apart)."""
    if index:
        return split.examples[index]
    reads = {n.target for n in split.modules[0].graph.nodes if n.op == "placeholder"}
    return mb_args, {k: v for k, v in mb_kwargs.items() if k in reads}


def own_inputs(split: StageSplit, index: int, args: tuple) -> tuple:
    """Of a stage's positional inputs, those its own program reads: not the values it only
    relays (passed on after them)."""
    relay = split.relays.get(index)
    return args[: relay.inputs] if relay else args


def stage_plans(model: nn.Module, mb_args: tuple, mb_kwargs: dict, plan: Plan,
                options_of: Callable[[Stage], Options], pins_of: Optional[Pins] = None,
                rank_budget: Optional[int] = None) -> tuple[Plan, ...]:
    """Step 4: every stage's plan on the sub-mesh, in stage order, each solved with
    options_of(stage) (passes/plan/pipeline.py stage_solve_options: its budget and the
    microbatches in flight). `pins_of`: the layouts a hand plan fixes in a stage's traced
    graph (passes/plan/hand_plans.py hand_pins; None: autopar chooses them all).
    `rank_budget`: the bytes a pipeline rank holding several stages (interleaved) may
    use; what its stages' plans leave of it goes to those that gave up speed for their
    share (spend_slack). The stages are traced and solved side by side, in forked
    workers (passes/plan/forked.py). The stages are split from a model holding a
    sample of each stage's blocks where they stretch (passes/plan/stage_sample.py), else
    from the whole model."""
    sample = stage_sample(model, plan.pipeline)
    if sample is not None:
        try:
            return _stage_plans(model, mb_args, mb_kwargs, plan, options_of, pins_of, rank_budget, sample)
        except NotStretched as refusal:
            LOG.info("stages planned from the whole model's split: %s", refusal)
    return _stage_plans(model, mb_args, mb_kwargs, plan, options_of, pins_of, rank_budget, None)


def _stage_plans(model: nn.Module, mb_args: tuple, mb_kwargs: dict, plan: Plan,
                 options_of: Callable[[Stage], Options], pins_of: Optional[Pins], rank_budget: Optional[int],
                 sample: Optional[StageSample]) -> tuple[Plan, ...]:
    p = plan.pipeline
    split = _planning_split(model, mb_args, mb_kwargs, plan, options_of(p.stages[0]).param_dtype, sample)
    sub = stage_mesh(plan.mesh, p.axis)

    @functools.cache  # spend_slack solves a stage again: traced once here (in the workers: each its own)
    def traced(stage: Stage) -> TracedGraph:
        args, kwargs = stage_inputs(split, stage.index, mb_args, mb_kwargs)
        short = trace_for_planning(split.modules[stage.index], own_inputs(split, stage.index, args), kwargs,
                                   options_of(stage).param_dtype)
        return stage_graph(short, sample.spans[stage.index], stage.index) if sample is not None else short

    def planned(stage: Stage, options: Options) -> Plan:
        graph = traced(stage)
        return plan_traced(graph, sub, options, pins_of(graph) if pins_of else None)[1]
    out = map_forked(lambda stage: planned(stage, options_of(stage)), p.stages)
    if rank_budget is None:
        return tuple(out)
    return spend_slack(out, p.stages, rank_budget,
                       lambda stage, budget: planned(stage, replace(options_of(stage), memory_budget_bytes=budget)))


def _planning_split(model: nn.Module, mb_args: tuple, mb_kwargs: dict, plan: Plan,
                    param_dtype: Optional[torch.dtype], sample: Optional[StageSample]) -> StageSplit:
    """split_stages of the whole model, or of the short model `sample` keeps; a short
    model that does not split is a NotStretched: the whole model's split raises what is
    the model's own (a PipelineError too: the short model's stages may pass other values)."""
    if sample is None:
        return split_stages(model, mb_args, mb_kwargs, plan.pipeline, plan.training, param_dtype)
    try:
        with short_model(model, sample):
            return split_stages(model, mb_args, mb_kwargs, plan.pipeline, plan.training, param_dtype)
    except Exception as failure:  # a forward that needs all its blocks (indexes them by count, say)
        raise NotStretched(f"the short model does not split: {type(failure).__name__}: {failure}") from failure


# a stage plan within this fraction of its budget was bound by it (may be faster with more)
PRESSED = 0.98


def spend_slack(plans: list[Plan], stages: tuple[Stage, ...], rank_budget: int,
                resolve: Callable[[Stage, int], Plan]) -> tuple[Plan, ...]:
    """A rank's stages, each first solved within an equal share of its budget: where
    their bytes leave some of it, each stage that recomputes blocks or sits at its share
    is solved again, in stage order, with its own bytes plus what is left, and keeps the
    faster plan. The rank's sum never passes its budget; no stage gets slower."""
    plans = list(plans)
    for rank in sorted({s.rank for s in stages}):
        mine = [s for s in stages if s.rank == rank]
        if len(mine) < 2:
            continue
        share = rank_budget // len(mine)
        for stage in mine:
            old = plans[stage.index]
            slack = rank_budget - sum(plans[s.index].memory_bytes for s in mine)
            if slack <= 0 or not (old.recompute or old.memory_bytes >= PRESSED * share):
                continue
            new = resolve(stage, old.memory_bytes + slack)
            if new.total_s < old.total_s:
                plans[stage.index] = new
    return tuple(plans)


def stage_options(options: Options) -> Options:
    """The options one stage is planned and run with, from the pipeline's: nothing more to
    pipeline, and its data-parallel gradients reduced once per step (after the last of its
    microbatches' backwards: Options.grad_sync_every)."""
    return replace(options, pipeline_axis=None, microbatches=1, grad_sync_every=options.microbatches)


class _StageInputs(torch.fx.Interpreter):
    """Runs the split graph once, recording what each stage module is called with and
    every value the graph passes between stages."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.calls: list[tuple[tuple, dict]] = []
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.values[n.name] = out = super().run_node(n)
        return out

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        self.calls.append((tuple(args), dict(kwargs)))
        return super().call_module(target, args, kwargs)


def _stage_examples(pipe: Any, args: tuple, kwargs: dict) -> tuple[list[tuple[tuple, dict]], dict[str, Any]]:
    """Per stage: (its positional inputs, its keyword inputs) for one microbatch, and every
    value the split graph passed, by node name."""
    placeholders = [n.target for n in pipe.split_gm.graph.nodes if n.op == "placeholder"]
    values = list(args) + [kwargs[name] for name in placeholders[len(args):]]
    recorder = _StageInputs(pipe.split_gm)
    with torch.no_grad():
        recorder.run(*values)
    return recorder.calls, recorder.values


def check_skips(pipe: Any, values: dict[str, Any], training: bool, schedule: Schedule) -> None:
    """A PipelineError for a value still read by more than one stage after relaying
    (relaying passes on what the stages make; a model input read past the first stage is
    not relayed) where torch cannot run it: a floating one in training (its gradient would
    go back to several stages), any under the interleaved schedule (adjacent stages only)."""
    for node in pipe.split_gm.graph.nodes:
        readers = [u.name for u in node.users if u.op == "call_module"]
        value = values.get(node.name)
        if len(readers) < 2 or not isinstance(value, torch.Tensor):
            continue
        what = (f"value {node.name} (shape {tuple(value.shape)}, {value.dtype}) is read by {len(readers)} "
                f"stages ({', '.join(readers)}); only values the stages make are relayed between them")
        if schedule is Schedule.INTERLEAVED_1F1B:
            raise PipelineError(f"{what}; torch's interleaved schedule passes values between adjacent stages only. "
                                "Use pipeline_schedule='1f1b' or 'gpipe'")
        if training and value.is_floating_point():
            raise PipelineError(f"{what}; torch.distributed.pipelining cannot send its gradient back to more than "
                                "one stage in training ('skip connections'). Compute what the later blocks need "
                                "from it before the first block, or plan without pipeline_axis")
