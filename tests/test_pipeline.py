"""Pipeline parallelism: the stage DP in closed form, pipelined plans and their JSON, the
errors for impossible requests, and (slow) losses and gradients on gloo ranks."""

from __future__ import annotations

import dataclasses
from typing import Optional
import warnings

import pytest
import torch

import autopar
from autopar.core.pipeline import PipelineError, Schedule, Stage
from autopar.core.plan import Plan
from autopar.passes.plan.pipeline import Units, microbatch_inputs, split_stages, stage_values, step_time
from autopar.passes.trace.stretch import alike_blocks
from autopar.passes.plan.pipeline_relay import Relayed, relay_skips
from autopar.passes.plan.pipeline_stages import _stage_examples, check_skips, split_model
from tests.models import build, inputs


def _gpt2(layers: int = 4):
    model = build("gpt2", n_layer=layers).train()
    return model, inputs("gpt2", batch=4)[1]


@pytest.fixture(scope="module")
def gpt2_plans():
    warnings.simplefilter("ignore")
    model, kw = _gpt2(2)
    piped = autopar.plan(model, (), kw, mesh=(2, 2), pipeline_axis=0, microbatches=2)
    auto = autopar.plan(model, (), kw, mesh=(2, 2), pipeline_axis="auto", microbatches=2)
    plain = autopar.plan(model, (), kw, mesh=(2, 2))
    return piped, auto, plain


def test_split_balances_the_slowest_stage():
    # blocks of 1 s; 2 s before the first block: stage 0 takes one block, stage 1 three
    units = Units("h", (1.0, 1.0, 1.0, 1.0), 2.0, 0.0, (0, 0, 0))
    assert split_stages(units, (0.0, 0.0, 0.0), 2) == ((0, 1), (1, 4))
    assert split_stages(Units("h", (1.0,) * 4, 0.0, 0.0, (0, 0, 0)), (0.0,) * 3, 2) == ((0, 2), (2, 4))
    # a costly boundary after block 1 moves the cut
    assert split_stages(Units("h", (1.0,) * 4, 0.0, 0.0, (0, 0, 0)), (0.0, 5.0, 0.0), 2) == ((0, 1), (1, 4))


def test_step_time_is_microbatches_times_slowest_plus_bubble():
    stages = (Stage(0, 0, 0, 2, 3.0, 10, 0.5), Stage(1, 1, 2, 4, 2.0, 0, 0.0))
    step, bubble = step_time(stages, ranks=2, microbatches=8)
    assert bubble == pytest.approx(3.5) and step == pytest.approx(8 * 3.5 + 3.5)


def test_interleaved_stages_alternate_ranks_and_shrink_the_bubble():
    units = Units("h", (1.0,) * 4, 0.0, 0.0, (0, 0, 0))
    ranges = split_stages(units, (0.0,) * 3, 4)
    stages = stage_values(units, (0.0,) * 3, (0, 0, 0), ranges, ranks=2)
    assert [(s.first, s.stop, s.rank) for s in stages] == [(0, 1, 0), (1, 2, 1), (2, 3, 0), (3, 4, 1)]
    step, bubble = step_time(stages, ranks=2, microbatches=4)
    assert bubble == pytest.approx(1.0) and step == pytest.approx(4 * 2.0 + 1.0)  # 1F1B: 4 * 2 + 2
    assert Schedule.of("interleaved_1f1b").chunks_per_rank == 2


def test_activations_in_flight_follow_the_schedule():
    from autopar.passes.plan.pipeline import in_flight
    stages = [Stage(k, k, k, k + 1, 1.0, 0, 0.0) for k in range(4)]
    assert [in_flight(Schedule.GPIPE, s, 4, 8) for s in stages] == [8, 8, 8, 8]
    assert [in_flight(Schedule.ONE_F_ONE_B, s, 4, 8) for s in stages] == [4, 3, 2, 1]
    assert [in_flight(Schedule.ONE_F_ONE_B, s, 4, 2) for s in stages] == [2, 2, 2, 1]


def test_pipelined_plan_records_stages_and_round_trips(gpt2_plans):
    piped, _, plain = gpt2_plans
    p = piped.pipeline
    assert p.axis == 0 and p.microbatches == 2 and p.schedule is Schedule.ONE_F_ONE_B
    assert p.container == "transformer.h" and p.blocks == 2
    assert [(s.first, s.stop) for s in p.stages] == [(0, 1), (1, 2)] and p.split_points == ("transformer.h.1",)
    hidden = 2 * 8 * 32 * 4  # one microbatch's hidden states, fp32; then the labels and masks the head reads
    assert hidden < p.stages[0].send_bytes <= hidden + 256 and p.stages[1].send_bytes == 0
    assert piped.total_s == pytest.approx(p.step_s)
    # the heaviest rank holds one stage's parameters, not the model's; in training their
    # gradient and AdamW state (4 + 8 bytes per 4-byte element) come on top
    whole = sum(x.numel() * 4 for x in _gpt2(2)[0].parameters())
    assert whole / 2 < piped.param_bytes < whole and piped.activation_bytes > 0
    assert piped.state_bytes == pytest.approx(3 * piped.param_bytes, rel=0.01)
    # each stage's own plan, on the sub-mesh without the pipeline axis, travels with it
    assert [sp.mesh.shape for sp in piped.stage_plans] == [(2,), (2,)]
    assert all(sp.nodes and sp.pipeline is None for sp in piped.stage_plans)
    # ... each priced, as each runs, with its data-parallel gradients reduced once per step
    assert [sp.grad_sync_every for sp in piped.stage_plans] == [2, 2]
    assert piped.stage_plans[0].fingerprint != piped.stage_plans[1].fingerprint != piped.fingerprint
    again = Plan.from_dict(piped.to_dict())
    assert again == piped and again.digest() == piped.digest()
    assert dataclasses.replace(piped, stage_plans=piped.stage_plans[::-1]).digest() != piped.digest()
    cut = piped.to_dict()
    cut["stage_plans"] = cut["stage_plans"][:1]  # a hand-edited file that lost a stage's plan
    with pytest.raises(autopar.PlanFileError, match="holds 1 stage plans for 2 pipeline stages"):
        Plan.from_dict(cut, "pipelined.json")
    other = dataclasses.replace(piped, pipeline=dataclasses.replace(p, microbatches=4))
    assert other.digest() != piped.digest()  # ranks with different schedules never agree
    assert "pipeline" not in plain.to_dict() and plain.pipeline is None


def test_auto_keeps_the_cheaper(gpt2_plans):
    piped, auto, plain = gpt2_plans
    assert auto.total_s == pytest.approx(min(plain.total_s, piped.total_s, auto.total_s))
    assert auto.total_s <= plain.total_s


@pytest.mark.slow  # 10 s of planning; the fast set keeps the round-trip and memory tests of pipelines
def test_a_hand_plan_holds_its_layouts_inside_each_stage_and_autopar_is_no_slower():
    # torchtitan's FSDP x TP x PP: fsdp_tp on the sub-mesh (2, 2) of every stage, the split
    # the same as autopar's own, so autopar's stages (a superset of the layouts) cost no more
    from autopar.core.errors import HandPlanError
    warnings.simplefilter("ignore")
    model, a, kw = _meta_llama()
    auto = autopar.plan(model, a, kw, mesh=(2, 2, 2), pipeline_axis=0, microbatches=4, device="h100")
    hand = autopar.hand_plan(model, a, kw, mesh=(2, 2, 2), style="fsdp_tp", pipeline_axis=0, microbatches=4,
                             device="h100")
    assert [(s.first, s.stop) for s in hand.pipeline.stages] == [(s.first, s.stop) for s in auto.pipeline.stages]
    assert len(hand.stage_plans) == 2 and auto.total_s <= hand.total_s * (1 + 1e-9)
    layouts = {n.name: str(n) for sp in hand.stage_plans for n in sp.nodes}
    assert layouts["p_model_layers_1_self_attn_q_proj_weight"].endswith("-> S(0)S(0)")  # fsdp x column
    assert layouts["p_model_layers_1_self_attn_o_proj_weight"].endswith("-> S(0)S(1)")  # fsdp x row
    with pytest.raises(HandPlanError, match=r"pipeline_axis='auto' chooses; give the axis number"):
        autopar.hand_plan(model, a, kw, mesh=(2, 2, 2), style="fsdp_tp", pipeline_axis="auto", microbatches=4)
    stages = r"inside the pipeline stages, on mesh \(2, 2\) without pipeline axis 0: "
    with pytest.raises(HandPlanError, match=stages + r".*'fsdp_tp' .* mesh \(2,\) has one axis"):
        autopar.hand_plan(model, a, kw, mesh=(2, 2), style="fsdp_tp", pipeline_axis=0, microbatches=4)


def _meta_llama():
    from autopar.tools.zoo import build as zoo_build
    return zoo_build("llama-tiny", batch=8, seq=16, training=True, device="meta", num_hidden_layers=2)


def test_bad_requests_name_the_value_and_the_fix():
    model, kw = _gpt2(2)
    with pytest.raises(PipelineError, match=r"microbatches=3 does not divide the batch.*pick microbatches"):
        microbatch_inputs((), kw, 3)
    with pytest.raises(PipelineError, match=r"asks for 4 stages .* only 2 blocks in transformer.h"):
        autopar.plan(model, (), kw, mesh=(4, 1), pipeline_axis=0, microbatches=2)
    with pytest.raises(PipelineError, match=r"pipeline_axis=2 is not an axis of mesh \(2, 2\)"):
        autopar.plan(model, (), kw, mesh=(2, 2), pipeline_axis=2)
    with pytest.raises(PipelineError, match=r"microbatches=0 must be a positive int"):
        autopar.plan(model, (), kw, mesh=(2, 2), pipeline_axis="auto", microbatches=0)
    with pytest.raises(PipelineError, match=r"needs example inputs and a loss"):
        autopar.compile(model, mesh=(2, 2), pipeline_axis=0, microbatches=2)
    with pytest.raises(PipelineError, match=r"pipeline_axis=0 with dynamic=True: .* drop one"):
        autopar.Options(pipeline_axis=0, dynamic=True)
    with pytest.raises(PipelineError, match=r"pipeline_schedule='zigzag' is not one of \['gpipe', '1f1b', 'interleaved_1f1b'\]"):
        autopar.Options(pipeline_schedule="zigzag")


class SkipNet(torch.nn.Module):
    """Four blocks and two values that skip stages when each block is a stage: a table made
    from a buffer (no gradient, as Llama's rotary tables) read by every block, and the
    first hidden state (with a gradient) read again after the last block."""

    def __init__(self, width: int = 8, reread_input: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, width))
        self.inp = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        self.reread_input = reread_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = first = self.inp(x)
        table = torch.cos(self.freq)
        for block in self.blocks:
            h = torch.tanh(block(h)) * table
        return h + first + (x if self.reread_input else 0)


def _split_skipnet(**kw):
    model, x = SkipNet(**kw), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return split_model(model, (x,), {}, ("blocks.1", "blocks.2", "blocks.3")), x


def test_relay_passes_skipping_values_through_the_stages_between():
    pipe, x = _split_skipnet()
    before = torch.fx.Interpreter(pipe.split_gm).run(x)
    own = [pipe.get_stage_module(k) for k in range(4)]
    own_inputs = [len([n for n in m.graph.nodes if n.op == "placeholder"]) for m in own]
    assert own_inputs == [1, 2, 2, 3]  # stage 3 reads the table and the first state straight from stage 0
    relays = relay_skips(pipe.split_gm, lambda val: val.is_floating_point())
    # stages 1 and 2 read the table (input 1) and pass it on; the first state, which only
    # stage 3 reads, comes in as a relay input (input 2); both go out after their own output
    assert relays == {1: Relayed(2, None, (1, 2)), 2: Relayed(2, None, (1, 2))}
    stages = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    for k, stage in enumerate(stages):  # every value a stage makes is read by the next stage only
        for value in [stage, *stage.users]:
            assert {stages.index(u) for u in value.users if u in stages} <= {k + 1}, value.format_node()
    assert [n.args[1] for n in stages[1].users] == [0, 1, 2]  # torch numbers outputs by their getitems
    torch.testing.assert_close(torch.fx.Interpreter(pipe.split_gm).run(x), before)
    # each stage's program is planned from its own module, left as it was
    assert [len([n for n in m.graph.nodes if n.op == "placeholder"]) for m in own] == own_inputs
    assert _stage_examples(pipe, (x,), {})[0][2][0][2].shape == (4, 8)  # the relayed first state reaches stage 2
    check_skips(pipe, _stage_examples(pipe, (x,), {})[1], True, Schedule.INTERLEAVED_1F1B)  # nothing left to refuse
    # what must_relay declines (here the first state) still goes straight to its reader
    pipe, x = _split_skipnet()
    assert relay_skips(pipe.split_gm, lambda val: val.dim() == 1) == {1: Relayed(2, None, (1,)),
                                                                      2: Relayed(2, None, (1,))}
    assert [len(n.args) for n in pipe.split_gm.graph.nodes if n.op == "call_module"] == [1, 2, 2, 3]


def test_a_model_input_read_by_several_stages_is_refused_by_name():
    pipe, x = _split_skipnet(reread_input=True)
    relay_skips(pipe.split_gm, lambda val: True)
    values = _stage_examples(pipe, (x,), {})[1]
    check_skips(pipe, values, False, Schedule.ONE_F_ONE_B)  # inference: torch sends it to both
    with pytest.raises(PipelineError, match=r"value x \(shape \(4, 8\), torch.float32\) is read by 2 stages .*relayed"
                                            r".*cannot send its gradient back"):
        check_skips(pipe, values, True, Schedule.ONE_F_ONE_B)
    with pytest.raises(PipelineError, match=r"adjacent stages only. Use pipeline_schedule='1f1b'"):
        check_skips(pipe, values, False, Schedule.INTERLEAVED_1F1B)


# ---- on gloo ranks -----------------------------------------------------------------

def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy (mean over tokens), the loss each microbatch backpropagates."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def pipeline_case(rank: int, world: int, family: str, mesh: tuple, axis: int, schedule: str,
                  microbatches: int = 2, batch: int = 4, layers: int = 2, offline: bool = False,
                  stage_plans: bool = True, squeeze: float = 0.0, param_dtype: Optional[torch.dtype] = None,
                  style: Optional[str] = None) -> dict:
    """This rank's loss and the full gradients of its stage's parameters (gathered over
    the stage's sub-mesh; returned by the sub-mesh's first rank), next to one device's.
    `offline`: the plan made with autopar.plan in rank 0 alone, saved, and run from its
    file on every rank; without its `stage_plans` (as a profiled plan is), each stage
    solves where it runs. `squeeze`: planned on rank 0 under a memory budget of this
    fraction of the unbounded plan's bytes, so stages store parameters sharded and
    recompute blocks. `param_dtype`: Options.param_dtype (mixed precision). `style`: the
    hand plan of that style inside every stage (autopar.hand_plan), planned on rank 0."""
    import copy
    from autopar.core.mesh import Mesh
    from autopar.runtime.state import gather_full
    warnings.simplefilter("ignore")
    depth = {"gpt2": {"n_layer": layers}, "llama": {"num_hidden_layers": layers}}[family]
    model = build(family, **depth).train()
    ids = inputs(family, batch=batch)[1]["input_ids"]
    ref = copy.deepcopy(model)
    ref_loss = lm_loss(ref(input_ids=ids).logits, ids)
    ref_loss.backward()
    from autopar.tools.simulated import CHEAP_COMM  # cheap links: the stages' plans split their inputs
    options = autopar.Options(pipeline_axis=axis, microbatches=microbatches, pipeline_schedule=schedule,
                              training=True, device=CHEAP_COMM, param_dtype=param_dtype)
    given = None
    if squeeze:
        def squeezed():
            free = autopar.plan(model, (), {"input_ids": ids}, mesh=mesh, options=options)
            bounded = dataclasses.replace(options, memory_budget_bytes=int(free.memory_bytes * squeeze))
            return autopar.plan(model, (), {"input_ids": ids}, mesh=mesh, options=bounded)
        given = _planned_on_rank0(squeezed)
    if style:
        given = _planned_on_rank0(lambda: autopar.hand_plan(model, (), {"input_ids": ids}, mesh=mesh, style=style,
                                                            options=options))
    if offline:
        import os
        import tempfile
        saved = _planned_on_rank0(lambda: autopar.plan(model, (), {"input_ids": ids}, mesh=mesh,
                                                       options=options).to_dict())
        if not stage_plans:
            del saved["stage_plans"]
        given = os.path.join(tempfile.mkdtemp(), "pipelined.json")
        autopar.Plan.from_dict(saved).to_json(given)
    pipe = autopar.compile(model, (), {"input_ids": ids}, mesh=mesh, options=options, loss_fn=lm_loss, plan=given)
    assert type(pipe) is autopar.ParallelModule and pipe.stages is not None  # one executor for every plan
    with pytest.raises(PipelineError, match=r"pm.step\(\*args, target=\.\.\., \*\*kwargs\), not pm\(\.\.\.\)"):
        pipe(input_ids=ids)
    with pytest.raises(PipelineError, match=r"pm.clip_grad_norm_ does not take a pipelined plan yet"):
        pipe.clip_grad_norm_(1.0)  # its shards are the stages': a norm over none would be silently 0
    with pytest.raises(PipelineError, match=f"microbatches={microbatches} does not divide the batch"):
        pipe.step(input_ids=ids[:3], target=ids[:3])
    loss = pipe.step(input_ids=ids, target=ids)
    grads = {}
    for stage in pipe.stages.stages:
        pm = stage.pm
        for name, spec in pm.state_specs.items():
            param = pm.shards.get_parameter(name) if name in dict(pm.shards.named_parameters()) else None
            if param is not None and param.grad is not None:
                grads[name] = gather_full(param.grad, spec, pm)
    lead = all(c == 0 for a, c in enumerate(Mesh.of(mesh).coords(rank)) if a != axis)
    return {"loss": loss, "ref_loss": ref_loss.detach(), "grads": grads if lead else {},
            "ref_grads": {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None},
            "stages": [(s.first, s.stop) for s in pipe.plan.pipeline.stages],
            "split_inputs": sum(r < s.pm.mesh.size for s in pipe.stages.stages for r in s.replicas),
            "solves": pipe.solve_count, "stage_plans": len(pipe.plan.stage_plans),
            "recomputed": [len(sp.recompute) for sp in pipe.plan.stage_plans],
            # per stage program with data-parallel buckets: (backwards per reduction, reductions in the step)
            "reductions": [(c.buckets.every, c.buckets.reductions) for s in pipe.stages.stages for c in s.pm.programs
                           if c.buckets.buckets],
            "layouts": {name: "".join(map(str, spec.placements)) for s in pipe.stages.stages
                        for name, spec in s.pm.state_specs.items()}}


def _check_pipeline(results: list, case: int) -> None:
    per_rank = [r[case] for r in results]
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert losses, "no rank returned the loss"
    for loss in losses:
        torch.testing.assert_close(loss, per_rank[0]["ref_loss"], rtol=1e-5, atol=1e-6)
    ref = per_rank[0]["ref_grads"]
    # a tied weight (GPT-2's wte and lm_head) has a copy in the first and in the last
    # stage; both get the one-device gradient (runtime/stages.py sync_tied_grads)
    pairs = [(name, g) for r in per_rank for name, g in r["grads"].items()]
    covered = {min(n for n in ref if ref[n] is ref[name]) for name, _ in pairs}
    assert {min(n for n in ref if ref[n] is g) for g in ref.values()} <= covered, sorted(covered)
    for name, g in pairs:
        torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def _planned_on_rank0(make):
    """A plan made once (rank 0) and sent to every rank: eight offline plans at once would
    only slow the spawn down."""
    import torch.distributed as dist
    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def plain_case(rank: int, world: int) -> dict:
    """pipeline_axis="auto" given the plain plan (what auto keeps when pipelining does not
    pay): one ParallelModule over the whole mesh, stepped like a pipeline."""
    import copy
    from autopar.runtime.state import gather_full
    from autopar.tools.simulated import CHEAP_COMM
    warnings.simplefilter("ignore")
    model = build("gpt2").train()
    ids = inputs("gpt2", batch=4)[1]["input_ids"]
    ref = copy.deepcopy(model)
    ref_loss = lm_loss(ref(input_ids=ids).logits, ids)
    ref_loss.backward()
    plain = _planned_on_rank0(lambda: autopar.plan(model, (), {"input_ids": ids}, mesh=(2, 4), training=True,
                                                   device=CHEAP_COMM))
    pipe = autopar.compile(model, (), {"input_ids": ids}, mesh=(2, 4), pipeline_axis="auto", microbatches=2,
                           training=True, device=CHEAP_COMM, plan=plain, loss_fn=lm_loss)
    loss = pipe.step(input_ids=ids, target=ids)
    assert type(pipe) is autopar.ParallelModule and pipe.stages is None
    pm = pipe
    grads = {name: gather_full(pm.shards.get_parameter(name).grad, spec, pm) for name, spec in pm.state_specs.items()
             if name in dict(pm.shards.named_parameters()) and pm.shards.get_parameter(name).grad is not None}
    return {"loss": loss, "ref_loss": ref_loss.detach(), "grads": grads if rank == 0 else {},
            "ref_grads": {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False) if p.grad is not None}}


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _against_one_device(model: torch.nn.Module, width: tuple[int, int], mesh: tuple, schedule: str,
                        rank: int) -> tuple[dict, object]:
    """One MSE step of `model` pipelined in stages over mesh axis 0 (4 microbatches) and
    on one device: losses and gradients (gathered whole on each stage's lead rank)."""
    import copy
    from autopar.runtime.state import gather_full
    warnings.simplefilter("ignore")
    x = torch.randn(8, width[0], generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, width[1], generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(model)
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    pipe = autopar.compile(model, (x,), mesh=mesh, pipeline_axis=0, microbatches=4, training=True, loss_fn=mse,
                           pipeline_schedule=schedule)
    loss = pipe.step(x, target=y)
    grads = {name: gather_full(s.pm.shards.get_parameter(name).grad, spec, s.pm)
             for s in pipe.stages.stages for name, spec in s.pm.state_specs.items()
             if name in dict(s.pm.shards.named_parameters())}
    lead = all(c == 0 for c in mesh_coords(mesh, rank)[1:])
    return {"loss": loss, "ref_loss": ref_loss.detach(), "grads": grads if lead else {},
            "ref_grads": {k: p.grad for k, p in ref.named_parameters()}}, pipe


def interleaved_case(rank: int, world: int, mesh: tuple) -> dict:
    """An MLP of 4 layers in 4 stages over 2 pipeline ranks (interleaved 1F1B): nothing
    skips a stage, which torch's interleaved schedule requires."""
    from tests.models import MLP
    torch.manual_seed(0)
    out, pipe = _against_one_device(MLP((16, 32, 32, 32, 16)).train(), (16, 16), mesh, "interleaved_1f1b", rank)
    return {**out, "stages": [(s.first, s.stop, s.rank) for s in pipe.plan.pipeline.stages]}


def skip_case(rank: int, world: int, mesh: tuple, schedule: str) -> dict:
    """SkipNet in 4 stages: the table and the first state skip stages and are relayed
    through the stages between (passes/plan/pipeline_relay.py); the first state's gradient
    comes back along the relay into stage 0's input layer."""
    out, pipe = _against_one_device(SkipNet().train(), (8, 8), mesh, schedule, rank)
    return {**out, "relayed": sorted(k for k, s in enumerate(pipe.stages.stages) if s.relay)}


def test_values_that_skip_stages_are_relayed_with_their_gradients():
    """4 gloo ranks: SkipNet in 4 stages on (4, 1) under 1F1B, and on (2, 2) under
    interleaved 1F1B (4 stages on 2 pipeline ranks, each on 2 ranks), against one device."""
    from tests.harness import run_ranks
    results = run_ranks(4, [(skip_case, dict(mesh=(4, 1), schedule="1f1b")),
                            (skip_case, dict(mesh=(2, 2), schedule="interleaved_1f1b"))])
    for case in (0, 1):
        _check_pipeline(results, case)
    assert [r[0]["relayed"] for r in results] == [[], [0], [0], []]  # stages 1 and 2 relay
    assert [r[1]["relayed"] for r in results] == [[1], [1], [0], [0]]  # stage 2 (rank 0's 2nd), stage 1


def mesh_coords(mesh: tuple, rank: int) -> tuple:
    from autopar.core.mesh import Mesh
    return Mesh.of(mesh).coords(rank)


def mismatch_case(rank: int, world: int) -> dict:
    """A plan made for other input shapes, refused on every rank."""
    warnings.simplefilter("ignore")
    model = build("llama", num_hidden_layers=4).train()
    ids = inputs("llama", batch=4)[1]["input_ids"]
    other = _planned_on_rank0(lambda: autopar.plan(model, (), {"input_ids": ids[:2]}, mesh=(4, 2), pipeline_axis=1,
                                                   microbatches=2, training=True))  # made for a batch of 2
    try:
        autopar.compile(model, (), {"input_ids": ids}, mesh=(4, 2), pipeline_axis=1, microbatches=2,
                        training=True, loss_fn=lm_loss, plan=other)
    except autopar.FingerprintMismatchError as e:
        return {"mismatch": str(e)}
    return {"mismatch": ""}


@pytest.mark.slow
def test_pipelined_losses_and_gradients_match_one_device():
    """8 gloo ranks, one spawn: GPT-2 with 4 layers on (4, 2) pipelining axis 0 under 1F1B
    (4 stages on 2 ranks each; the boolean mask stage 0 makes goes straight to stages 2 and
    3), Llama on (2, 2, 2) pipelining axis 0 under GPipe (2 stages, each on a (2, 2)
    sub-mesh; its plan made offline and stripped of its stage plans); Llama with 4 layers
    in 4 stages on (4, 2) under 1F1B (its rotary tables, made before the first block,
    relayed to every stage); a plan for other shapes refused; "auto" keeping the plain plan
    steps one ParallelModule over (2, 4); an MLP in 4 stages on 2 pipeline ranks of (2, 4)
    under interleaved 1F1B; GPT-2 with 6 layers on (2, 2, 2) under 1F1B (2 stages), its
    split priced on a sample of its blocks, its plan made offline, read from a file and
    checked against the sample on the ranks. Every stage all-reduces its data-parallel gradients once a step."""
    from tests.harness import run_ranks
    cases = [(pipeline_case, dict(family="gpt2", mesh=(4, 2), axis=0, schedule="1f1b", layers=4,
                                  microbatches=4, batch=8)),
             (pipeline_case, dict(family="llama", mesh=(2, 2, 2), axis=0, schedule="gpipe", offline=True,
                                  stage_plans=False)),
             (mismatch_case, {}), (plain_case, {}), (interleaved_case, dict(mesh=(2, 4))),
             (pipeline_case, dict(family="llama", mesh=(4, 2), axis=0, schedule="1f1b", layers=4,
                                  microbatches=4, batch=8)),
             (pipeline_case, dict(family="gpt2", mesh=(2, 2, 2), axis=0, schedule="1f1b", offline=True, layers=6))]
    results = run_ranks(8, cases)
    for i in (0, 1, 3, 4, 5, 6):
        _check_pipeline(results, i)
    assert results[0][4]["stages"] == [(0, 1, 0), (1, 2, 1), (2, 3, 0), (3, 4, 1)]
    assert results[0][0]["stages"] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert results[0][1]["stages"] == [(0, 1), (1, 2)]
    assert results[0][5]["stages"] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert len(results[0][6]["stages"]) == 2 and results[0][6]["stages"][-1][1] == 6
    assert alike_blocks(build("gpt2", n_layer=6)) is not None  # its split priced on a 4-block sample
    # the stages' own plans split some input they receive, so the gradients sent back are
    # assembled from blocks (runtime/stages.py step 4), not merely passed through
    assert sum(r[i]["split_inputs"] for r in results for i in range(2)) > 0
    assert all("the given plan was made for LlamaForCausalLM" in r[2]["mismatch"] for r in results)
    # every stage runs the plan rank 0 made for it, stored in the pipelined plan: only rank
    # 0 solves (the pipelined plan, once), and no rank where that plan came from a file
    # made offline (case 6)
    for i in (0, 5, 6):
        assert all(r[i]["stage_plans"] == len(r[i]["stages"]) for r in results), [r[i]["stage_plans"] for r in results]
        assert [r[i]["solves"] for r in results] == [0 if i == 6 else 1] + [0] * 7, [r[i]["solves"] for r in results]
    # a pipelined plan without stage plans: the first rank of each stage's sub-mesh solves
    assert [r[1]["solves"] for r in results] == [1, 0, 0, 0, 1, 0, 0, 0] and results[0][1]["stage_plans"] == 0
    # each stage's data-parallel buckets sum its microbatches' gradients and all-reduce
    # them once in the step (Options.grad_sync_every, runtime/buckets.py), under 1F1B
    # (cases 0, 5, 6) and GPipe (case 1); with a reduction per microbatch there would be M
    microbatches = {0: 4, 1: 2, 5: 4, 6: 2}
    for i, m in microbatches.items():
        assert all(r[i]["reductions"] and set(r[i]["reductions"]) == {(m, 1)} for r in results), \
            (i, [r[i]["reductions"] for r in results])


@pytest.mark.slow
def test_stages_planned_from_a_short_split_run_and_match_one_device():
    """4 gloo ranks: Llama with 10 layers on (2, 2) under 1F1B, 5 blocks a stage, so rank
    0 plans the stages from the short model's split (passes/plan/stage_sample.py); the
    ranks split the whole model, check each stage plan's fingerprint against their own
    trace, and train as one device does."""
    from tests.harness import run_ranks
    from autopar.core.pipeline import PipelinePlan, Schedule
    from autopar.passes.plan.stage_sample import stage_sample
    case = dict(family="llama", mesh=(2, 2), axis=0, schedule="1f1b", layers=10, microbatches=2, offline=True)
    results = run_ranks(4, [(pipeline_case, case)])
    _check_pipeline(results, 0)
    stages = tuple(Stage(k, k, first, stop, 0.0, 0, 0.0) for k, (first, stop) in enumerate(results[0][0]["stages"]))
    assert all(s.stop - s.first > 4 for s in stages), stages
    pipeline = PipelinePlan(0, 2, Schedule.ONE_F_ONE_B, "model.layers", 10, stages, 0.0, 0.0)
    assert stage_sample(build("llama", num_hidden_layers=10), pipeline) is not None


@pytest.mark.slow
def test_stages_lean_under_a_budget_and_still_match_one_device():
    """4 gloo ranks: GPT-2 with 4 layers on (2, 2) pipelining axis 0 under 1F1B, planned
    under 45 % of the unbounded plan's bytes: both stages recompute blocks inside their
    own plans (stage 0, holding two microbatches, more of them), the losses and every
    gradient as one device's. (On these nearly free links the unbounded plan stores most
    parameters whole, data parallel; storing them sharded alone reaches about 70 % of its
    bytes, so 45 % takes recompute.)"""
    from tests.harness import run_ranks
    results = run_ranks(4, [(pipeline_case, dict(family="gpt2", mesh=(2, 2), axis=0, schedule="1f1b", layers=4,
                                                 squeeze=0.45))])
    _check_pipeline(results, 0)
    recomputed = results[0][0]["recomputed"]
    assert recomputed[0] > recomputed[1] > 0, recomputed


@pytest.mark.slow
def test_a_hand_plan_inside_the_stages_runs_and_matches_one_device():
    """4 gloo ranks: GPT-2 with 4 layers on (2, 2) pipelining axis 0 under 1F1B, each
    stage laid out as the fsdp hand plan on its 2 ranks (every parameter whose first dim
    divides stored split along it, gathered where used): the stages hold those layouts,
    the losses and every gradient are one device's."""
    from tests.harness import run_ranks
    results = run_ranks(4, [(pipeline_case, dict(family="gpt2", mesh=(2, 2), axis=0, schedule="1f1b", layers=4,
                                                 style="fsdp"))])
    _check_pipeline(results, 0)
    layouts = results[0][0]["layouts"]
    assert layouts["transformer.h.0.mlp.c_fc.weight"] == "S(0)", layouts
    assert layouts["transformer.h.0.ln_1.weight"] == "S(0)", layouts


@pytest.mark.slow
def test_a_bf16_pipeline_tracks_one_device():
    """2 gloo ranks: Llama with 4 layers in 2 stages on (2, 1) under 1F1B with
    param_dtype=bfloat16 (the stage graphs torch's split records assert fp32 dtypes, which
    the planner and the runtime drop), against one fp32 device: bf16 tolerances."""
    from tests.harness import run_ranks
    results = run_ranks(2, [(pipeline_case, dict(family="llama", mesh=(2, 1), axis=0, schedule="1f1b", layers=4,
                                                 param_dtype=torch.bfloat16))])
    per_rank = [r[0] for r in results]
    want = per_rank[0]["ref_loss"]
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert losses and all(abs(loss - want) <= 2e-2 * abs(want) for loss in losses), (losses, want)
    grads = [(name, g) for r in per_rank for name, g in r["grads"].items()]
    assert len(grads) == len(per_rank[0]["ref_grads"])
    for name, g in grads:
        ref = per_rank[0]["ref_grads"][name]
        assert g.dtype == torch.float32 and (g - ref).norm() <= 5e-2 * ref.norm() + 1e-6, name


@pytest.mark.slow
def test_llama_interleaved_relays_its_rotary_tables():
    """2 gloo ranks: Llama with 4 layers in 4 stages on (2, 1) under interleaved 1F1B. Its
    rotary tables and mask move between adjacent stages only (relayed), and the keyword
    input torch hands to both stages of a rank reaches stage 0 only."""
    from tests.harness import run_ranks
    results = run_ranks(2, [(pipeline_case, dict(family="llama", mesh=(2, 1), axis=0, schedule="interleaved_1f1b",
                                                 layers=4, microbatches=4, batch=8))])
    _check_pipeline(results, 0)
    assert results[0][0]["stages"] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_the_first_stage_takes_every_keyword_and_later_stages_none():
    """torch's interleaved schedule hands the step's keywords to every stage of a rank: the
    first stage must take them all (a keyword its plan never saw fails there, as the model
    would, instead of being dropped unread); a later stage takes none."""
    from autopar.runtime.stages import StageModule

    class Seen:
        options = autopar.Options()

        def __call__(self, *args, **kwargs):
            self.kwargs = kwargs
            return args[0]

    x = torch.ones(2)
    for first, want in ((True, {"input_ids", "attention_mask"}), (False, set())):
        pm = Seen()
        stage = StageModule(pm, None, torch.fx.symbolic_trace(torch.nn.Identity()), first=first)
        stage(x, input_ids=x, attention_mask=x)
        assert set(pm.kwargs) == want


def one_program_step_case(rank: int, world: int) -> dict:
    """pm.step on a plan of one program (no pipeline): forward, loss, backward, as for a
    pipelined plan; without a loss_fn it is refused."""
    import copy
    from autopar.runtime.state import gather_full
    from tests.models import MLP
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = MLP((16, 32, 16)).train()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    ref_loss = mse(ref(x), y)
    ref_loss.backward()
    pm = autopar.compile(model, (x,), mesh=(world,), training=True, loss_fn=mse)
    loss = pm.step(x, target=y)
    grads = {name: gather_full(pm.shards.get_parameter(name).grad, spec, pm) for name, spec in pm.state_specs.items()}
    bare = autopar.compile(copy.deepcopy(ref), (x,), mesh=(world,), training=True)
    try:
        bare.step(x, target=y)
        refused = ""
    except PipelineError as e:
        refused = str(e)
    return {"loss": loss, "ref_loss": ref_loss.detach(), "grads": grads, "refused": refused,
            "ref_grads": {k: p.grad for k, p in ref.named_parameters()}, "stages": pm.stages}


def test_step_trains_a_plan_of_one_program_as_it_trains_a_pipeline():
    from tests.harness import run_ranks
    for (res,) in run_ranks(2, [(one_program_step_case, {})]):
        assert res["stages"] is None
        torch.testing.assert_close(res["loss"], res["ref_loss"], rtol=1e-5, atol=1e-6)
        assert set(res["grads"]) == set(res["ref_grads"])
        for name, g in res["grads"].items():
            torch.testing.assert_close(g, res["ref_grads"][name], rtol=1e-4, atol=1e-5)
        assert "pm.step(...) needs the loss" in res["refused"], res["refused"]


def saved_pipeline_case(rank: int, world: int, path: str) -> dict:
    """A pipelined plan's file (a book of one, as pm.plan_book saves it) given to compile
    without pipeline_axis: it runs as the pipeline it is, no rank solving."""
    import copy
    from tests.models import MLP
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = MLP((16, 32, 32, 16)).train()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(model)
    ref_loss = mse(ref(x), y)
    pm = autopar.compile(model, (x,), mesh=(world,), training=True, loss_fn=mse, plan=path)
    loss = pm.step(x, target=y)
    try:
        pm.prepare((x,), {})
        refused = ""
    except PipelineError as e:
        refused = str(e)
    return {"loss": loss, "ref_loss": ref_loss.detach(), "solves": pm.solve_count, "piped": pm.stages is not None,
            "refused": refused}


def test_a_saved_pipelined_plan_runs_as_a_pipeline_without_pipeline_axis(tmp_path):
    from tests.harness import run_ranks
    from tests.models import MLP
    torch.manual_seed(0)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(MLP((16, 32, 32, 16)).train(), (x,), mesh=(2,), pipeline_axis=0, microbatches=2,
                            training=True)
    path = str(tmp_path / "book.json")
    autopar.PlanBook.of([plan]).to_json(path)
    results = run_ranks(2, [(saved_pipeline_case, {"path": path})])
    assert any(res["loss"] is not None for (res,) in results)
    for (res,) in results:
        assert res["piped"] and res["solves"] == 0, res
        assert "has no program of its own to prepare" in res["refused"], res["refused"]
        if res["loss"] is not None:  # the last stage's ranks
            torch.testing.assert_close(res["loss"], res["ref_loss"], rtol=1e-5, atol=1e-6)
