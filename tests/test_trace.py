"""Tracing (passes/trace/trace.py): the fingerprint tells graphs apart, the user's model is left
as it was, every input layout torch.export takes is traced, writes to state are refused."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autopar.core.errors import TraceError, UnsupportedModelError
from autopar.core.kinds import NodeKind
from autopar.passes.trace.trace import flatten_inputs, trace


class Div(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.div(a, b, rounding_mode=self.mode)


def test_fingerprint_tells_apart_graphs_that_differ_only_in_a_keyword_argument():
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    floor, trunc = trace(Div("floor"), (a, b)), trace(Div("trunc"), (a, b))
    assert floor.fingerprint != trunc.fingerprint
    assert trace(Div("floor"), (a, b)).fingerprint == floor.fingerprint


def test_tracing_leaves_the_kv_cache_setting_of_the_users_config_as_it_was():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers")
    from autopar.tools.zoo import build
    model, args, kwargs = build("gpt2-tiny", batch=2, seq=8, use_cache=True)
    assert model.config.use_cache is True
    traced = trace(model, args, kwargs)
    assert model.config.use_cache is True
    assert traced.out_spec.num_leaves == 2  # loss and logits: traced without the cache


SEEN_USE_CACHE: list[bool] = []


class WithPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + torch.arange(x.shape[-1], device=x.device, dtype=x.dtype)  # device= is a kwarg


def test_fingerprint_does_not_depend_on_the_device():
    # a plan made on the meta device (or on rank 0's cuda:0) is for every rank's device
    on_cpu = trace(WithPositions(), (torch.randn(2, 8),))
    on_meta = trace(WithPositions().to("meta"), (torch.randn(2, 8, device="meta"),))
    assert on_cpu.fingerprint == on_meta.fingerprint


class ChoosesByGradMode(nn.Module):
    """Stands for torch's own kernel choices: under no_grad SDPA may take a kernel whose
    output strides make a later `.contiguous()` a no-op that the trace drops (doge)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1).contiguous() if torch.is_grad_enabled() else x.transpose(0, 1).clone()


def test_the_callers_grad_mode_does_not_shape_the_trace():
    # a plan made in grad mode (as planning offline is) must fit a call under no_grad
    with torch.enable_grad():
        with_grad = trace(ChoosesByGradMode().eval(), (torch.randn(2, 8),))
    with torch.no_grad():
        without = trace(ChoosesByGradMode().eval(), (torch.randn(2, 8),))
    assert with_grad.fingerprint == without.fingerprint


@pytest.mark.slow
def test_doge_traces_alike_with_and_without_gradients():
    from autopar.tools.sweep_configs import Task, Tiny
    prints = []
    for grad in (True, False):
        model, kwargs = Tiny("doge", "DogeForCausalLM", Task.CAUSAL_LM, training=False).build()
        with torch.set_grad_enabled(grad):
            prints.append(trace(model, (), kwargs).fingerprint)
    assert prints[0] == prints[1]


class FailsToExport(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(use_cache=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN_USE_CACHE.append(self.config.use_cache)
        if x.sum() > 0:  # data-dependent control flow: export refuses it
            return x
        return -x


def test_config_is_restored_when_tracing_fails():
    model = FailsToExport()
    SEEN_USE_CACHE.clear()
    with pytest.raises(TraceError):
        trace(model, (torch.randn(4),))
    assert SEEN_USE_CACHE and not any(SEEN_USE_CACHE)  # the cache was off while tracing
    assert model.config.use_cache is True


class OptionalMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor | None = None, c: torch.Tensor | None = None) -> torch.Tensor:
        out = self.proj(a)
        if b is not None:
            out = out * b
        return out + c if c is not None else out


def test_none_between_tensor_arguments_traces():
    a, c = torch.randn(2, 4), torch.randn(2, 4)
    traced = trace(OptionalMiddle(), (a, None, c))
    assert traced.input_paths == ("args[0]", "args[2]")
    assert sum(gi.kind is NodeKind.USER_INPUT for gi in traced.inputs) == 2


def test_inputs_with_none_in_different_slots_flatten_differently():
    a, c = torch.randn(2, 4), torch.randn(2, 4)
    _, spec1, consts1 = flatten_inputs((a, None, c), {})
    _, spec2, consts2 = flatten_inputs((a, c, None), {})
    assert (str(spec1), repr(consts1)) != (str(spec2), repr(consts2))


class WritesBuffer(nn.Module):
    def __init__(self, through_view: bool) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(4))
        self.through_view = through_view

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_view:
            self.count[0].fill_(1.0)  # a write through a view: functionalised
        else:
            self.count.add_(1.0)
        return x + self.count


@pytest.mark.parametrize("through_view", [False, True], ids=["direct", "through a view"])
def test_a_write_to_a_buffer_is_an_output_that_updates_it(through_view):
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced
    from autopar.tools.simulated import CHEAP_COMM, simulate_against

    model, x = WritesBuffer(through_view).eval(), torch.randn(2, 4)  # no parameters: nothing to train
    traced = trace(model, (x,))
    assert [u.target for u in traced.buffer_updates] == ["count"]
    assert traced.out_spec.num_leaves == 1  # the new value is not one of the model's outputs
    plan = plan_traced(traced, Mesh((2,)), Options(device=CHEAP_COMM))[1]
    simulate_against(model, (x,), {}, traced, plan, context="buffer write")  # outputs and the new count
    assert not model.count.any()  # the simulator ran on copies


class WritesParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4), requires_grad=False)  # frozen, so eager allows the write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.weight.mul_(0.5)
        return x * self.weight


def test_a_write_to_a_parameter_is_refused_naming_it():
    with pytest.raises(UnsupportedModelError) as err:
        trace(WritesParameter(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "parameter weight" in msg and "WritesParameter" in msg and "node " in msg, msg


class SliceWrite(nn.Module):
    """`y[:, :half] = proj(x)`: functionalised into `slice_scatter(copy(...))`, whose
    `aten.copy` has no derivative; trace spells it in differentiable ops."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8)
        self.out = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.out(x)
        y[:, :, :8] = self.proj(x)[:, :, 0:1].to(torch.float64)  # cast and broadcast by the write
        return y


def test_a_slice_write_trains_and_matches_one_device_on_a_sharded_plan():
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced
    from tests import cases
    from autopar.tools.simulated import simulate_against

    torch.manual_seed(0)
    model = SliceWrite().train()
    x = torch.randn(4, 6, 16)
    traced = trace(model, (x,))
    copies = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.copy.default]
    assert not copies, "aten.copy (no derivative) left in the graph"
    plan = plan_traced(traced, Mesh((2,)), Options(device=cases.CHEAP_COMM))[1]
    assert simulate_against(model, (x,), {}, traced, plan, context="slice write") == 4


class NoGradRegion(nn.Module):
    """A `with torch.no_grad():` block inside forward (a fixed-point step, a target
    network): torch.export wraps it in a higher-order op with a nested graph."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            target = torch.tanh(self.inner(x))
            scale = target.abs().mean(-1, keepdim=True)
        return self.outer(x) * scale + target


def test_a_no_grad_region_is_inlined_and_lets_no_gradient_through():
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced
    from autopar.tools.simulated import CHEAP_COMM, simulate_against

    torch.manual_seed(0)
    model = NoGradRegion().train()
    x = torch.randn(4, 6, 16)
    traced = trace(model, (x,))
    assert not [n for n in traced.gm.graph.nodes if n.op == "get_attr" or isinstance(n.target, torch._ops.HigherOrderOperator)]
    plan = plan_traced(traced, Mesh((2,)), Options(device=CHEAP_COMM))[1]
    # all four parameters compared: the inner two must get no gradient on any rank
    assert simulate_against(model, (x,), {}, traced, plan, context="no_grad region") == 4
    model.zero_grad()
    model(x).sum().backward()
    assert model.inner.weight.grad is None  # the reference: no gradient into the region


class NoGradCast(nn.Module):
    """A no_grad region that casts a value to the dtype it has (`h.float()` of a float,
    as dots3_note's indexer does): eager returns `h` itself, and torch.export then hands
    the cast out of the region to `h`'s readers after it."""

    def __init__(self) -> None:
        super().__init__()
        self.pre, self.inner, self.outer = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        with torch.no_grad():
            scale = self.inner(h.float()).abs().mean(-1, keepdim=True)
        return self.outer(h) * scale


def test_a_value_a_no_grad_region_casts_to_its_own_dtype_keeps_its_gradient_outside():
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced
    from autopar.tools.simulated import CHEAP_COMM, simulate_against

    torch.manual_seed(0)
    model = NoGradCast().train()
    x = torch.randn(4, 6, 16)
    traced = trace(model, (x,))
    plan = plan_traced(traced, Mesh((2,)), Options(device=CHEAP_COMM))[1]
    # pre's gradient comes through outer(h) alone; it was lost with the region's detach
    assert simulate_against(model, (x,), {}, traced, plan, context="cast in a no_grad region") == 6


class NestedCacheModel(nn.Module):
    """A multimodal-style model: the cache switch lives in a sub-config (text_config) and in
    a submodule's own config, as in transformers' *ForConditionalGeneration models."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import PretrainedConfig
        text, own = PretrainedConfig(), PretrainedConfig()
        text.use_cache = own.use_cache = True
        self.config = PretrainedConfig(text_config=text)
        self.language_model = nn.Linear(8, 8)
        self.language_model.config = own

    def forward(self, x: torch.Tensor):
        y = self.language_model(x)
        if self.config.text_config.use_cache or self.language_model.config.use_cache:
            return y, {"cache": [y * 2]}  # a cache torch.export would have to return
        return (y,)


def test_the_kv_cache_is_off_in_sub_configs_while_tracing_and_restored_after():
    pytest.importorskip("transformers")
    model = NestedCacheModel()
    traced = trace(model, (torch.randn(2, 8),))
    assert traced.out_spec.num_leaves == 1
    assert model.config.text_config.use_cache is True and model.language_model.config.use_cache is True


class _StraightThroughRound(torch.autograd.Function):
    """Quantisation-aware training's straight-through estimator: rounds forward, passes the
    gradient through unchanged backward (not the derivative of round, which is zero) -
    as transformers' YOSO (YosoCumulation) has a backward that is not its forward's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class CustomBackward(nn.Module):
    """Linear -> a custom autograd.Function -> Linear."""

    def __init__(self, function: type = _StraightThroughRound) -> None:
        super().__init__()
        self.inner, self.outer, self.function = nn.Linear(16, 16), nn.Linear(16, 16), function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.function.apply(self.inner(x)))


def test_a_custom_autograd_function_backward_is_kept_or_the_training_trace_refused():
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced
    from autopar.tools.simulated import CHEAP_COMM, simulate_against

    torch.manual_seed(0)
    model = CustomBackward().train()
    x = torch.randn(4, 6, 16)
    try:
        traced = trace(model, (x,))
    except (TraceError, UnsupportedModelError) as e:
        assert "_StraightThroughRound" in str(e)  # refused, naming the function
        return
    plan = plan_traced(traced, Mesh((2,)), Options(device=CHEAP_COMM))[1]
    # with the backward lost, inner's gradients are zero on every rank (round's derivative)
    assert simulate_against(model, (x,), {}, traced, plan, context="custom backward") == 4


def test_a_custom_autograd_function_traces_for_inference():
    # the forward is what one device runs: only a training trace loses something
    model, x = CustomBackward().eval(), torch.randn(4, 6, 16)
    with torch.no_grad():
        torch.testing.assert_close(trace(model, (x,)).gm(*_graph_args(model, x))[0], model(x))


def _graph_args(model: nn.Module, x: torch.Tensor) -> list:
    traced = trace(model, (x,))
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    return [x if gi.kind is NodeKind.USER_INPUT else state[gi.target] for gi in traced.inputs]


class CountsInNoGrad(nn.Module):
    def __init__(self, write_parameter: bool = False) -> None:
        super().__init__()
        self.proj, self.write_parameter = nn.Linear(8, 8), write_parameter
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if self.write_parameter:
                self.proj.weight.mul_(0.5)  # a parameter written where autograd does not look
            self.calls.add_(1)
        return self.proj(x) * self.calls


def test_a_write_inside_a_no_grad_region_is_a_buffer_update_or_refused():
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced
    from autopar.tools.simulated import CHEAP_COMM, simulate_against
    model, x = CountsInNoGrad().train(), torch.randn(4, 8)
    traced = trace(model, (x,))
    assert [u.target for u in traced.buffer_updates] == ["calls"]
    plan = plan_traced(traced, Mesh((2,)), Options(device=CHEAP_COMM))[1]
    simulate_against(model, (x,), {}, traced, plan, context="counter in no_grad")  # buffers compared too
    with pytest.raises(UnsupportedModelError, match="proj.weight"):
        trace(CountsInNoGrad(write_parameter=True).train(), (x,))


class _HandGelu(torch.autograd.Function):
    """A forward and its exact derivative written by hand (as BLOOM's GeLU is), with an
    in-place write on a saved value in the forward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        y = torch.tanh(x)
        y.mul_(0.5)
        return y

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 0.5 * (1 - torch.tanh(x) ** 2)


def test_a_custom_autograd_function_whose_backward_is_exact_trains():
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced
    from autopar.tools.simulated import CHEAP_COMM, simulate_against
    torch.manual_seed(0)
    model, x = CustomBackward(_HandGelu).train(), torch.randn(4, 6, 16)
    traced = trace(model, (x,))
    plan = plan_traced(traced, Mesh((2,)), Options(device=CHEAP_COMM))[1]
    assert simulate_against(model, (x,), {}, traced, plan, context="exact custom backward") == 4


def test_the_traced_forms_match_one_device_on_gloo_ranks():
    # the forms above, each checked in the simulator, also through autopar.compile on 2
    # real gloo ranks: outputs and every local gradient
    from tests import cases
    from tests.harness import run_ranks
    per_rank = run_ranks(2, [(cases.trace_forms, dict(mesh=(2,)))])
    for rank, (results,) in enumerate(per_rank):
        assert len(results) == 5
        for name, res in results.items():
            torch.testing.assert_close(*res["output"], msg=lambda m: f"rank {rank}, {name}: {m}")
            assert res["grads"], f"{name}: no gradients compared"
            for param, (got, want, spec) in res["grads"].items():
                if want is None:
                    assert got is None or not got.any(), f"rank {rank}, {name}: {param} got a gradient"
                    continue
                torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank}, {name}, grad of {param} ({spec}): {m}")
