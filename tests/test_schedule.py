"""The schedule of emitted rank programs: every wait after its start, starts as early as
their input exists with independent compute before their wait, bytes in flight capped,
and the scheduled program still equal to one device (in the lockstep simulator)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import fx

from autopar.core.kinds import StepKind
from autopar.core.resharding import Step
from autopar.passes.lower.emit import emit
from autopar.passes.plan.hand_plans import hand_plan
from autopar.passes.lower.program import StepModule, WaitModule
from autopar.passes.lower.schedule import inflight_bytes, schedule
from autopar.passes.trace.trace import trace
from tests import models
from autopar.tools.simulated import simulate_against


def _fsdp_program(cap_bytes, model="gpt2", mesh=(1, 4)):
    m = models.build(model).train()
    args, kwargs = models.inputs(model, batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = hand_plan(m, args, kwargs, mesh=mesh, style="fsdp", device="h100")
    traced = trace(m, args, kwargs)
    return emit(traced, plan, (0, 1), inflight_cap_bytes=cap_bytes), plan


def _steps(program):
    nodes = list(program.gm.graph.nodes)
    kinds = {}
    for i, n in enumerate(nodes):
        if n.op == "call_module":
            kinds[n] = (i, program.gm.get_submodule(n.target))
    starts = {n: i for n, (i, m) in kinds.items() if isinstance(m, StepModule) and
              any(isinstance(kinds.get(u, (0, None))[1], WaitModule) for u in n.users)}
    waits = {n: i for n, (i, m) in kinds.items() if isinstance(m, WaitModule)}
    return nodes, starts, waits


def test_every_wait_follows_its_start_and_precedes_every_use():
    program, _ = _fsdp_program(cap_bytes=1 << 40)
    nodes, starts, waits = _steps(program)
    assert len(starts) == len(waits) > 10
    for w, i in waits.items():
        s = w.args[0]
        assert starts[s] < i
        assert all(nodes.index(u) > i for u in w.users)


def test_starts_are_issued_early_with_independent_compute_before_their_wait():
    """FSDP: every parameter is stored split and gathered at use; with room in flight
    the gathers of later layers start before the compute of earlier ones."""
    program, _ = _fsdp_program(cap_bytes=1 << 40)
    nodes, starts, waits = _steps(program)
    compute_between = []
    for s, i in starts.items():
        w = next(u for u in s.users if u in waits)
        between = [n for n in nodes[i + 1: waits[w]] if n.op == "call_function"]
        compute_between.append(len(between))
    assert sum(1 for c in compute_between if c > 0) >= len(starts) // 2
    assert max(compute_between) > 20  # a gather of a late layer started far ahead


def test_bytes_in_flight_stay_under_the_cap():
    big, plan = _fsdp_program(cap_bytes=1 << 40)
    cap = 3 * max(inflight_bytes(big.gm.get_submodule(s.target).step, plan.mesh.shape) for s in _steps(big)[1])
    program, plan = _fsdp_program(cap_bytes=cap)
    nodes, starts, waits = _steps(program)
    inflight, worst = {}, 0
    for n in nodes:
        if n in starts:
            inflight[n] = inflight_bytes(program.gm.get_submodule(n.target).step, plan.mesh.shape)
            worst = max(worst, sum(inflight.values()))
        elif n in waits:
            inflight.pop(n.args[0])
    assert 0 < worst <= cap
    # and the cap really held back starts that the uncapped schedule issued earlier
    first_wait = min(waits.values())
    assert sum(1 for i in starts.values() if i < first_wait) < sum(
        1 for i in _steps(big)[1].values() if i < min(_steps(big)[2].values()))


@pytest.mark.parametrize("model,mesh,style", [("gpt2", (2, 2), "fsdp"), ("llama", (1, 4), "megatron"),
                                              ("gpt2", (2, 2), "dp_tp")])
def test_scheduled_programs_match_one_device(model, mesh, style):
    """Outputs and parameter gradients of the scheduled programs of every rank, run in
    lockstep, equal the single-device model's."""
    m = models.build(model).train()
    args, kwargs = models.inputs(model, batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = hand_plan(m, args, kwargs, mesh=mesh, style=style, device="h100")
    compared = simulate_against(m, args, kwargs, trace(m, args, kwargs), plan, context=f"{model} {style}")
    assert compared > 5


def test_a_start_still_missing_its_input_holds_back_no_later_start():
    """c waits on a two-step reshard of a, whose second start needs the first's result;
    e on a one-step reshard of b. b's start is issued as soon as b exists, before c runs
    (it used to wait behind the second step of a's reshard, issued only when c needed it),
    so it runs beside c and d; the two-step chain's order is kept."""
    root = torch.nn.Module()
    graph = fx.Graph()
    x = graph.placeholder("x")
    a, b = graph.call_function(torch.relu, (x,)), graph.call_function(torch.sin, (x,))
    values = {}
    for name, source in (("a1", a), ("a2", None), ("b1", b)):
        step = Step(StepKind.ALL_GATHER, axis=0, dim=0)
        root.add_module(name, StepModule(step, name))
        root.add_module(name + "_wait", WaitModule(step, name))
        started = graph.call_module(name, (source if source is not None else values["a1"],))
        values[name] = graph.call_module(name + "_wait", (started,))
    c = graph.call_function(torch.add, (values["a2"], 1.0))
    d = graph.call_function(torch.cos, (x,))
    e = graph.call_function(torch.mul, (values["b1"], d))
    graph.output((c, e))
    gm = schedule(fx.GraphModule(root, graph), (4,))
    order = [n.name for n in gm.graph.nodes]
    assert order.index("b1") < order.index(c.name) < order.index(d.name) < order.index("b1_wait")
    assert order.index("a1") < order.index("a1_wait") < order.index("a2") < order.index("a2_wait") < order.index(c.name)
