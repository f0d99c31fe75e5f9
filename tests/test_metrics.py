"""Per-step metrics (autopar/runtime/metrics.py) on a real one-rank gloo group: a step's
time runs from one forward to the next, its tokens are the token ids' elements, its
model FLOPs the plan's ops at their global shapes."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import autopar
from autopar.core.pipeline import PipelineError
from autopar.cost_models.devices import preset
from autopar.runtime.metrics import plan_flops, token_count
from tests import models
from tests.models import MLP


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _compiled(model, args, kwargs=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.compile(model, args, kwargs or {}, mesh=(1,), device="cpu")


def test_a_step_is_timed_from_one_call_to_the_next(one_rank_group):
    model = models.build("llama").train()
    args, kwargs = models.inputs("llama", batch=2, seq=8)
    pm = _compiled(model, args, kwargs)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    assert pm.last_step is None
    t0 = time.perf_counter()
    pm(*args, **kwargs).loss.backward()
    opt.step()
    time.sleep(0.05)  # the loop's own work (data, logging) is part of the step
    pm(*args, **kwargs).loss.backward()
    outer = time.perf_counter() - t0
    m = pm.last_step
    assert m is not None and 0.05 < m.seconds < outer
    assert m.tokens == 2 * 8
    assert m.tokens_per_s_per_device == pytest.approx(16 / m.seconds)
    assert m.model_flops == pytest.approx(plan_flops(pm.plan, training=True))
    peak = preset("cpu").peak_flops[torch.float32]
    assert m.mfu == pytest.approx(m.model_flops / m.seconds / peak) and 0 < m.mfu < 1
    assert m.peak_memory_bytes > 2**20 and m.memory_kind.startswith("cpu")
    assert "tokens/s/device" in str(m) and "MFU" in str(m)
    with torch.no_grad():  # a call without autograd counts the forward only
        pm(*args, **kwargs)
        pm(*args, **kwargs)
    assert pm.last_step.model_flops == pytest.approx(plan_flops(pm.plan, training=False))
    assert plan_flops(pm.plan, training=False) < m.model_flops / 2


def test_model_flops_of_an_mlp_are_its_matmuls_and_elementwise_ops():
    # widths 16 -> 64 -> 16 -> 64 -> 16 at batch 32: four addmm of 2*B*in*out each, three
    # relus of B*out elements; training adds two matmuls per matmul and one pass per relu
    from autopar import plan
    model = MLP().train()
    x = torch.randn(32, 16)
    p = plan(model, (x,), mesh=(1,), device="cpu")
    matmuls = sum(2 * 32 * a * b for a, b in [(16, 64), (64, 16), (16, 64), (64, 16)])
    relus = 32 * (64 + 16 + 64)
    assert plan_flops(p, training=False) == pytest.approx(matmuls + relus, rel=0.05)
    assert plan_flops(p, training=True) == pytest.approx(3 * matmuls + 2 * relus, rel=0.05)


def test_tokens_are_the_token_ids_else_the_samples():
    ids, mask, x = (torch.zeros(4, 9, dtype=torch.long), torch.ones(4, 9), torch.randn(6, 3))
    positions, causal = torch.zeros(1, 9, dtype=torch.long), torch.ones(4, 1, 9, 9, dtype=torch.bool)

    def leaves(*ts):
        return [(t.dtype, tuple(t.shape)) for t in ts]

    assert token_count(leaves(mask, ids)) == 36
    assert token_count(leaves(positions, causal, ids)) == 36  # the largest 2-D integer input
    assert token_count(leaves(positions, ids), ("kwargs['position_ids']", "kwargs['input_ids']")) == 36
    assert token_count(leaves(x)) == 6


def test_a_pipelined_plan_says_its_metrics_are_not_measured():
    from autopar.runtime.module import ParallelModule
    with pytest.raises(PipelineError, match="plans of one program"):
        ParallelModule.last_step.fget(type("Piped", (), {"stages": object()})())
