"""The CUDA path (skipped without CUDA, tests/conftest.py): NCCL with one rank, the
functional collectives and their waits on NCCL's stream, programs on the GPU (an 8-way
sharded program's ranks run in the simulator on one device), torch.compile through
Inductor's GPU code, and bf16 compute. NCCL refuses two ranks on one GPU, so several
ranks stay on gloo (every other test file); here the GPU-specific pieces run.

Matmuls run in full fp32 (TF32 off) so that the fp32 tolerances of the CPU tests hold."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.plan.planning import plan_traced
from autopar.passes.trace.trace import trace
from autopar.runtime.compiling import CompileFallbackWarning
from autopar.tools.simulated import CHEAP_COMM, loss_of, simulate_against
from tests import models

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)  # an index: init_process_group(device_id=...) wants one


@pytest.fixture(scope="module")
def nccl_one_rank():
    """A one-rank NCCL process group in this process (torch.distributed allows one per
    process: the module's tests share it)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1,
                                device_id=CUDA)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _gpt2_on_cuda(seed: int = 0):
    model = models.build("gpt2", seed=seed).to(CUDA).train()
    _, kwargs = models.inputs("gpt2", batch=4, seq=16)
    return model, {k: v.to(CUDA) for k, v in kwargs.items()}


def test_functional_collectives_start_and_wait_on_nccl(nccl_one_rank):
    from autopar.runtime.collectives import AxisComm, Move, all_gather, all_reduce, finish, launch, reduce_scatter
    from autopar.core.kinds import StepKind
    group = dist.group.WORLD
    comm = AxisComm(group, 1, 0, group.group_name)
    x = torch.randn(8, 4, device=CUDA)
    assert torch.equal(all_reduce(x, comm), x) and torch.equal(all_gather(x, 0, comm), x)
    assert torch.equal(reduce_scatter(x, 1, comm), x)
    started = launch(Move(StepKind.ALL_REDUCE), x * 2, comm)  # returns before the collective is done
    y = torch.relu(x) + 1  # compute queued between start and wait
    assert torch.equal(finish(Move(StepKind.ALL_REDUCE), started, comm), x * 2) and y.device == x.device


def test_compiled_module_on_nccl_matches_one_device(nccl_one_rank):
    model, kwargs = _gpt2_on_cuda()
    ref = models.build("gpt2", seed=0).to(CUDA).train()
    pm = autopar.compile(model, (), kwargs, mesh=(1,), device="h200")
    out, want = pm(**kwargs), ref(**kwargs)
    torch.testing.assert_close(out.logits, want.logits)
    loss_of(out).backward()
    loss_of(want).backward()
    _assert_gradients_match(pm, ref)


def test_eight_way_program_runs_on_the_gpu_and_matches_one_device():
    torch.backends.cuda.matmul.allow_tf32 = False
    model, kwargs = _gpt2_on_cuda()
    traced = trace(model, (), kwargs)
    plan = plan_traced(traced, Mesh((2, 4)), Options(device=CHEAP_COMM))[1]
    assert any(not n.outputs[0].is_replicated() for n in plan.nodes if n.outputs), "the plan shards nothing"
    assert simulate_against(model, (), kwargs, traced, plan, context="gpt2 (2, 4) on cuda") > 0


def test_torch_compile_of_the_rank_program_on_the_gpu(nccl_one_rank):
    model, kwargs = _gpt2_on_cuda()
    ref = models.build("gpt2", seed=0).to(CUDA).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)  # Inductor must not fall back on CUDA
        pm = autopar.compile(model, (), kwargs, mesh=(1,), device="h200", compile=True)
        out = pm(**kwargs)
    want = ref(**kwargs)
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)  # Inductor fuses and reorders sums
    loss_of(out).backward()
    loss_of(want).backward()
    _assert_gradients_match(pm, ref, rtol=1e-4, atol=1e-4)


def test_cuda_graphs_of_the_rank_program_train_as_one_device(nccl_one_rank):
    """Options.cuda_graphs: three SGD steps replayed as CUDA graphs (collectives inside),
    losses and weights after them against the plain model's eager steps."""
    model, kwargs = _gpt2_on_cuda()
    ref = models.build("gpt2", seed=0).to(CUDA).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileFallbackWarning)
        pm = autopar.compile(model, (), kwargs, mesh=(1,), device="h200", cuda_graphs=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (pm, ref)]
    for _ in range(3):
        losses = []
        for module, opt in zip((pm, ref), opts):
            loss = loss_of(module(**kwargs))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach().clone())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-4)
    want = dict(ref.named_parameters(remove_duplicate=False))
    for name in _read_parameters(pm):  # on one rank each shard is the whole weight
        torch.testing.assert_close(pm.shards.get_parameter(name), want[name], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{name} after 3 steps: {m}")


def test_bf16_compute_with_fp32_masters_on_the_gpu(nccl_one_rank):
    model, kwargs = _gpt2_on_cuda()
    ref = models.build("gpt2", seed=0).to(CUDA).train()
    pm = autopar.compile(model, (), kwargs, mesh=(1,), device="h200", param_dtype=torch.bfloat16,
                         reduce_dtype=torch.float32)
    loss = pm(**kwargs).loss
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = ref(**kwargs).loss
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want.float(), rtol=2e-2, atol=2e-2)  # bf16: 8 bits of mantissa
    loss.backward()
    masters = [pm.shards.get_parameter(name) for name in _read_parameters(pm)]
    assert masters and all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
                           for p in masters)


def _read_parameters(pm) -> list[str]:
    """State-dict keys of the parameters the program reads (a tied twin it never reads is left out)."""
    used = {e.producer for e in pm.plan.edges}
    return [gi.target for gi in pm.current.traced.inputs if gi.kind == "parameter" and gi.name in used]


def _assert_gradients_match(pm, ref, **tolerance) -> None:
    """On one rank every local shard is the whole parameter: its gradient equals one device's."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    names = _read_parameters(pm)
    assert names
    for name in names:
        torch.testing.assert_close(pm.shards.get_parameter(name).grad, want[name].grad, **tolerance,
                                   msg=lambda m: f"grad of {name}: {m}")


def test_auto_device_picks_this_gpus_preset_and_memory():
    """The default Options.device ("auto") on a CUDA machine: the preset its name picks,
    the memory torch reports for it, and the summary naming both."""
    from autopar.cost_models.devices import detected_device
    spec = detected_device()
    name = torch.cuda.get_device_name(0)
    assert spec.detected == name and spec.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    plan = autopar.plan(models.build("mlp"), (torch.randn(8, 16),), mesh=(2,))
    assert plan.device == spec.name != "cpu" and f"auto-detected {name}" in plan.summary(), plan.summary()
