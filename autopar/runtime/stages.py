"""A pipelined plan's stages on torch.distributed.pipelining, each stage an autopar program
(a ParallelModule with a pipelined plan runs them: autopar/runtime/module.py).

    model --pipeline(split at plan.pipeline.split_points)--> stage modules 0..S-1
    rank r (pipeline coordinate k) -> stage k's module, planned and run by autopar on the
    sub-mesh of the ranks whose coordinate is k -> torch's build_stage(pipe.info(), group:
    the pipeline axis) -> ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B with loss_fn

1. The first rank plans (passes/plan/pipeline.py: stages chosen by the DP, then every stage's
   own plan, passes/plan/pipeline_stages.py) and sends the plan to every rank; a given Plan
   skips it (pipelined_plan). A plan without a pipeline (pipeline_axis="auto" found that
   pipelining does not pay) runs as one program, with no stages.
2. Every rank makes the groups of every stage's sub-mesh and of the pipeline axis
   (groups.stage_groups), and splits the model as the planner did
   (pipeline_stages.split_stages: torch's pipeline() at the plan's block boundaries, one
   microbatch through the split graph to learn what each stage module is called with).
3. Its stage module becomes a ParallelModule on the stage's sub-mesh, given the stage's
   plan (the sub-mesh's ranks trace it together and check its fingerprint; none solves).
   A plan without stage plans (a profiled cost model, which times each stage where it
   runs) has the sub-mesh solve. Stage outputs are full tensors, so the next stage's
   ranks each receive the whole activation from their counterpart.
4. Each stage runs with Options.grad_sync_every = its microbatches (pipeline_stages.
   stage_options): its data-parallel gradient buckets sum the microbatches' gradients and
   all-reduce once per step, after the last backward (autopar/runtime/buckets.py).
   Gradients sent back: autopar gives each rank the exact gradient of its own block of
   an input (grad-sync steps complete replicated ones), so the full input gradient is the
   sum over the sub-mesh of the zero-padded blocks, divided by the number of ranks
   holding each block (_FullInputGrad); every rank then sends the same full gradient.
5. After each step, a tied parameter with a copy in several stages (GPT-2's wte and
   lm_head) gets the summed gradient in every copy (sync_tied_grads), so copies step alike.
6. A value read by a stage further than the next one (Llama's rotary tables) is relayed
   through the stages in between (passes/plan/pipeline_relay.py) where torch cannot send it
   straight: floating in training (torch takes a gradient back from one reader only), any
   under the interleaved schedule. A relaying stage returns a copy of the relay input
   after its own outputs (StageModule.forward); its own program never sees it.
7. What torch's schedules still cannot run is refused up front, naming the value
   (pipeline_stages.check_skips).
8. State (autopar/runtime/pipeline_state.py): full_state_dict / load_full_state_dict under
   the original model's names, and the per-rank view training checkpoints save and load.
"""

from __future__ import annotations

from math import prod
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from autopar.core.errors import FingerprintMismatchError, MeshError
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.pipeline import Schedule, stage_mesh
from autopar.core.placement import Replicate, local_chunk
from autopar.core.plan import Plan
from autopar.passes.lower.emit import check_fingerprint
from autopar.passes.plan.block_sample import priced_trace, sampled_trace
from autopar.passes.plan.pipeline import microbatch_inputs, stage_solve_options
from autopar.passes.plan.planner import plan_model
from autopar.passes.plan.pipeline_relay import Relayed
from autopar.passes.plan.pipeline_stages import computing_in, split_stages, stage_inputs, stage_options
from autopar.passes.plan.planning import planning_inputs
from autopar.passes.trace.stretch import alike_blocks
from autopar.passes.trace.trace import trace
from autopar.runtime.groups import check_world, stage_groups
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline_state import (PipelineCheckpoint, gather_pipeline_state, load_pipeline_state, name_table,
                                            original_name, read_names)
from autopar.runtime.agree import agreed
from autopar.runtime.state import gather_full

# torch.distributed.pipelining is imported where a pipeline is built, not with this
# module: it brings torch._dynamo and DTensor (about a second of CPU) into every process
# that imports autopar's API, pipelined or not (a CLI call, every rank of a plain plan)
SCHEDULE_CLASSES = {Schedule.GPIPE: "ScheduleGPipe", Schedule.ONE_F_ONE_B: "Schedule1F1B",
                    Schedule.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B"}


class _FullInputGrad(torch.autograd.Function):
    """Identity forward; backward: the full gradient of a stage input from each rank's
    exact gradient of its block (step 4): sum over the sub-mesh / ranks per block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, replicas: int) -> torch.Tensor:
        ctx.group, ctx.replicas = group, replicas
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad = grad.contiguous().clone()
        if ctx.group is not None:
            dist.all_reduce(grad, group=ctx.group)
        return grad / ctx.replicas, None, None


class StageModule(nn.Module):
    """What torch's pipeline stage runs: one stage's ParallelModule, its inputs' gradients made
    whole for the previous stage, and the values it relays (step 6) passed on after its outputs."""

    def __init__(self, pm: ParallelModule, group: Any, split: torch.fx.GraphModule,
                 relay: Optional[Relayed] = None, first: bool = False, last: bool = False) -> None:
        super().__init__()
        self.pm, self.group, self.relay = pm, group, relay
        self.first = first  # the first stage: the only one that takes the model's keyword inputs
        # under Options.param_dtype the split was traced in it (passes/plan/pipeline_stages.py)
        # and torch's stages receive each value in the dtype it had there: per output, that
        # dtype (prepare records it); the last stage's outputs go to the loss as they are
        self.cast_sends = pm.options.param_dtype is not None and not last
        self.send_dtypes: tuple[Optional[torch.dtype], ...] = ()
        self.__dict__["split"] = split  # torch's stage module (not a submodule: its weights are not ours)
        self.replicas: tuple[int, ...] = ()
        self.differentiable: tuple[bool, ...] = ()  # which outputs carry a gradient in torch's own stage

    @property
    def graph(self) -> torch.fx.Graph:
        """The split stage's graph, whose placeholders and output torch's stage reads."""
        return self.__dict__["split"].graph

    def prepare(self, args: tuple, kwargs: dict) -> None:
        """Trace and plan for one microbatch now (every rank of the sub-mesh together)."""
        own = args[: self.relay.inputs] if self.relay else args
        self.pm.prepare(own, kwargs)
        specs = list(self.pm.input_specs.values())[: len(own)]
        shape = self.pm.mesh.shape
        self.replicas = tuple(prod(n for p, n in zip(s.placements, shape) if isinstance(p, Replicate))
                              for s in specs)
        with torch.enable_grad():  # torch sends a gradient back only for outputs that have one
            inputs = tuple(x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
                           for x in args)
            with computing_in(self.__dict__["split"], self.pm.options.param_dtype) as cast:
                outs = self.__dict__["split"](*cast(inputs), **cast(kwargs))
        outs = outs if isinstance(outs, tuple) else (outs,)
        self.differentiable = tuple(isinstance(o, torch.Tensor) and o.requires_grad for o in outs)
        self.send_dtypes = tuple(o.dtype if isinstance(o, torch.Tensor) else None for o in outs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        own = args[: self.relay.inputs] if self.relay else args
        own = tuple(_FullInputGrad.apply(x, self.group, r)
                    if isinstance(x, torch.Tensor) and x.requires_grad and self.pm.mesh.size > 1 else x
                    for x, r in zip(own, self.replicas + (1,) * len(own)))
        # torch's interleaved schedule hands the step's keywords to every stage on this rank;
        # the first takes them all (one its plan never saw fails there, not dropped unread)
        out = self.pm(*own, **(kwargs if self.first else {}))
        if self.cast_sends:
            out = tuple(map(_as_sent, out, self.send_dtypes + (None,) * len(out))) if isinstance(out, tuple) else \
                _as_sent(out, self.send_dtypes[0])
        if self.relay:
            # a copy (not the received tensor itself, which torch detaches in place after
            # backward): its gradient, whole on every rank already, adds to the input's
            relayed = tuple(args[j].clone() for j in self.relay.passed)
            out = ((out,) if self.relay.outputs is None else tuple(out)) + relayed
        if not isinstance(out, tuple):
            return out
        # a value made from no parameter (a mask, rotary tables) leaves torch's stage without
        # a gradient; autopar's may attach one, and torch cannot send it back to two stages
        return tuple(o if keep or not isinstance(o, torch.Tensor) else o.detach()
                     for o, keep in zip(out, self.differentiable + (True,) * len(out)))




def _as_sent(value: Any, dtype: Optional[torch.dtype]) -> Any:
    """`value` in the dtype torch's stage expects for it (floating tensors only)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and dtype is not None and dtype != value.dtype:
        return value.to(dtype)
    return value


def pipelined_plan(model: nn.Module, args: tuple, kwargs: dict, mesh: Mesh, options: Options,
                   given: Optional[Plan]) -> Plan:
    """Step 1: the plan every rank runs, rank 0's (passes/plan/pipeline.py) or the given one,
    checked against this model and these inputs (a plan without a pipeline, where
    pipeline_axis="auto" found that pipelining does not pay, runs as one program)."""
    check_world(mesh)
    if given is not None and given.mesh != mesh:
        raise MeshError(f"the given plan is for mesh {given.mesh.shape}, not {mesh.shape}; plan again for this "
                        "mesh or pass the mesh it was made for")
    return agreed(lambda: plan_model(model, args, kwargs, mesh, options) if given is None
                  else _checked(given, model, args, kwargs, options))


class PipelineStages:
    """This rank's stages of a pipelined plan and the torch schedule that drives them;
    what a ParallelModule runs when its plan has a pipeline (autopar/runtime/module.py).

    step(*args, target=labels, **kwargs) runs one training step over all microbatches
    (forward, loss_fn, backward) and returns the mean loss on the ranks of the last stage
    (None elsewhere); gradients are left in the stages' parameters."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, mesh: Mesh, options: Options,
                 loss_fn: Callable[..., torch.Tensor], plan: Plan, planned_here: bool) -> None:
        assert plan.pipeline is not None
        self.mesh, self.options, self.loss_fn, self.plan = mesh, options, loss_fn, plan
        self.planned_here = planned_here  # this rank solved the plan (rank 0, without a given plan)
        self.stages: list[StageModule] = []
        self.tied: tuple = ()  # tied parameters whose copies in several stages get one gradient
        self.pipe_group: Any = None
        self.stage_indices: list[int] = []  # the stage number of each of self.stages
        self.schedule = self._build(model, args, kwargs)

    def _build(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Steps 2 and 3."""
        from torch.distributed import pipelining
        p, mesh, device = self.plan.pipeline, self.mesh, torch.device("cpu")
        sub_groups, pipe_group = stage_groups(mesh, p.axis, device, self.options.collective_timeout_s)
        mb_args, mb_kwargs = microbatch_inputs(args, kwargs, p.microbatches)
        self.pipe_group = pipe_group
        self.tied = tied_parameters(model)
        split = split_stages(model, mb_args, mb_kwargs, p, self.plan.training, self.options.param_dtype)
        self._remember_state(model, list(split.modules))
        coordinate = mesh.coords(dist.get_rank())[p.axis]
        solving = stage_solve_options(self.plan, self.options)
        torch_stages = []
        for stage in p.stages:
            if stage.rank != coordinate:
                continue
            ins, kw = stage_inputs(split, stage.index, mb_args, mb_kwargs)
            given = self.plan.stage_plans[stage.index] if self.plan.stage_plans else None
            # a stage without a stored plan solves here, as the planner would have solved it
            options = stage_options(self.options) if given else solving[stage.index]
            pm = ParallelModule(split.modules[stage.index], stage_mesh(mesh, p.axis), options, given,
                                groups=sub_groups)
            module = StageModule(pm, sub_groups.group, split.pipe.get_stage_module(stage.index),
                                 split.relays.get(stage.index), first=stage.index == 0,
                                 last=stage.index == len(p.stages) - 1)
            module.prepare(ins, kw)
            self.stages.append(module)
            self.stage_indices.append(stage.index)
            # torch's stage for a pipeline() split: it routes every value to the stage that
            # reads it, as the graph says (after relaying: the next stage)
            torch_stages.append(pipelining.build_stage(module, stage.index, split.pipe.info(), device, pipe_group))
        schedule = getattr(pipelining, SCHEDULE_CLASSES[p.schedule])
        if p.schedule is Schedule.INTERLEAVED_1F1B:
            return schedule(torch_stages, n_microbatches=p.microbatches, loss_fn=self.loss_fn)
        return schedule(torch_stages[0], n_microbatches=p.microbatches, loss_fn=self.loss_fn)

    def _remember_state(self, model: nn.Module, modules: list[nn.Module]) -> None:
        """The original model's state names (in order, with shapes and dtypes) and a copy of
        any state no stage holds, for full_state_dict and checkpoints (pipeline_state.py)."""
        self.originals = name_table(model)
        state = model.state_dict()
        self.state_order = tuple(state)
        self.state_meta = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in state.items())
        self.read = {k: read_names(m) for k, m in enumerate(modules)}
        held = {original_name(n, self.originals) for m in modules for n in m.state_dict()}
        self.unread = {n: t.detach().clone() for n, t in state.items() if n not in held}
        self.transient = {n: t.detach().clone() for n, t in model.named_buffers() if n not in state}

    @property
    def solve_count(self) -> int:
        """ILP solves this rank ran: the pipelined plan's, and each stage's without a stage
        plan (0 when the plan was given)."""
        return int(self.planned_here) + sum(s.pm.solve_count for s in self.stages)

    def _own_stages(self) -> list[tuple[int, ParallelModule]]:
        return [(k, s.pm) for k, s in zip(self.stage_indices, self.stages)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters and buffers on every rank, under the original
        model's state-dict names (a tied parameter under each of its names, one value):
        loadable with model.load_state_dict. Every rank calls it."""
        return gather_pipeline_state(self._own_stages(), self.state_order, self.originals, self.unread,
                                     self.pipe_group, self.read)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Each of this rank's stages takes its block of each full tensor (keys: the original
        model's state-dict names)."""
        load_pipeline_state(self._own_stages(), state_dict, self.originals, self.unread, self.transient)

    def checkpoint_view(self) -> PipelineCheckpoint:
        """What save_training_checkpoint / load_training_checkpoint read and write on this
        rank: its stages."""
        p = self.plan.pipeline
        return PipelineCheckpoint(self._own_stages(), self.mesh, self.mesh.coords(dist.get_rank())[p.axis], p,
                                  self.state_meta, self.plan.digest())

    def _holds_last(self) -> bool:
        """Whether this rank runs the last stage (where step returns the loss)."""
        p = self.plan.pipeline
        return p.stages[-1].rank == self.mesh.coords(dist.get_rank())[p.axis]

    def modules(self) -> list[ParallelModule]:
        """This rank's stages' programs, in stage order (their shards are its parameters)."""
        return [s.pm for s in self.stages]

    def step(self, *args: Any, target: Optional[torch.Tensor] = None, **kwargs: Any) -> Optional[torch.Tensor]:
        if args or kwargs:  # a clear PipelineError where torch would fail to chunk them
            microbatch_inputs(args, kwargs, self.plan.pipeline.microbatches)
        losses: list = []
        first = self.plan.pipeline.stages[0].rank == self.mesh.coords(dist.get_rank())[self.plan.pipeline.axis]
        if not first:  # torch hands the inputs to every stage this rank runs: only the first takes them
            args, kwargs = (), {}
        for stage in self.stages:  # each stage reduces its gradients after its last microbatch's backward
            for program in stage.pm.programs:
                program.buckets.restart()
        self.schedule.step(*args, target=target, losses=losses, **kwargs)
        sync_tied_grads(self.tied, [s.pm for s in self.stages], self.pipe_group)
        if not self._holds_last():
            return None
        return torch.stack([x.detach() for x in losses]).mean()


def _checked(plan: Plan, model: nn.Module, args: tuple, kwargs: dict, options: Options) -> Plan:
    """A given plan, after checking it was made for this model and these inputs (the
    first rank traces; a FingerprintMismatchError reaches every rank). A pipelined plan
    carries the graph its split was priced on, one microbatch through a sample of the
    model's alike blocks or through the whole model (passes/plan/block_sample.py
    priced_trace), a plain one the whole batch's; each stage plan is checked where its
    stage's ranks trace it."""
    if plan.pipeline is None:  # the whole trace, not one stretched from a sample: the check the plan must pass
        whole = trace(model, *planning_inputs(model, args, kwargs), options.param_dtype)
        check_fingerprint(plan, whole, "the given plan")
        return plan
    args, kwargs = microbatch_inputs(args, kwargs, plan.pipeline.microbatches)
    sampled, sample = sampled_trace(model, args, kwargs, options.param_dtype, alike_blocks(model))
    if sample is not None and sampled.fingerprint == plan.fingerprint:
        if sample.blocks != plan.pipeline.blocks:
            raise FingerprintMismatchError(
                f"the given plan splits {plan.pipeline.blocks} blocks of {plan.pipeline.container} into stages, but "
                f"this {sampled.model_name} has {sample.blocks}; re-plan for this model",
                expected=f"{plan.fingerprint} x {plan.pipeline.blocks} blocks",
                found=f"{sampled.fingerprint} x {sample.blocks} blocks")
        return plan
    whole = sampled if sample is None else priced_trace(model, args, kwargs, options.param_dtype)
    check_fingerprint(plan, whole, "the given plan")
    return plan


def tied_parameters(model: nn.Module) -> tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]:
    """Names that share one parameter (GPT-2's wte and lm_head), with its shape: after the
    split each stage holding one has its own copy."""
    names: dict[int, list[str]] = {}
    shapes: dict[int, tuple[int, ...]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        shapes[id(param)] = tuple(param.shape)
    return tuple(sorted((tuple(sorted(n)), shapes[k]) for k, n in names.items() if len(n) > 1))


@torch.no_grad()
def sync_tied_grads(tied: tuple, stages: list[ParallelModule], pipe_group: Any) -> None:
    """Every copy of a tied parameter gets the sum of all copies' gradients (the one-device
    gradient), so the copies step alike: each rank adds the full gradients of the copies
    its stages hold, the pipeline axis sums them, each copy takes its block back."""
    for names, shape in tied:
        full, held = None, []
        for pm in stages:
            seen: set[int] = set()
            for name in names:
                param = dict(pm.shards.named_parameters()).get(name) if name in pm.state_specs else None
                if param is None or param.grad is None or id(param) in seen:
                    continue
                seen.add(id(param))
                whole = gather_full(param.grad, pm.state_specs[name], pm)
                full = whole.clone() if full is None else full + whole
                held.append((pm, name, param))
        if full is None:
            full = torch.zeros(shape)
        dist.all_reduce(full, group=pipe_group)
        for pm, name, param in held:
            param.grad.copy_(local_chunk(full, pm.state_specs[name], pm.mesh.shape, pm.coords))
