"""Stateful buffers: in-place writes to buffers carried through the plan, BatchNorm in
training equal to one device (statistics of the whole batch when the batch is split,
as SyncBatchNorm computes them).

The simulator checks (fast): TinyResNet(norm="batch") in train mode on (2,) and (2, 2),
two SGD steps, outputs, every rank's gradients and every rank's block of the running
statistics and num_batches_tracked after each step, the second step starting from the
state the simulated ranks hold. One real gloo spawn (2 ranks) trains the same model for
two SGD steps through autopar.compile and compares full_state_dict, the gradients and
the sharded (checkpoint) state dict with one device."""

from __future__ import annotations

import warnings

import pytest
import torch

from autopar.core.kinds import NodeKind
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.plan.planning import plan_traced
from autopar.passes.trace.trace import trace
from autopar.tools.simulated import CHEAP_COMM, simulate_sgd_steps
from tests import cases
from tests.harness import run_ranks
from tests.models import TinyResNet


def _batches(n: int) -> list[tuple[tuple, dict]]:
    gen = torch.Generator().manual_seed(3)
    return [((torch.randn(8, 3, 8, 8, generator=gen),), {}) for _ in range(n)]


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = TinyResNet(norm="batch").train()
    return model, trace(model, *_batches(1)[0])


def test_batch_norm_training_traces_its_buffer_updates(resnet):
    _, traced = resnet
    targets = [u.target for u in traced.buffer_updates]
    per_norm = ("running_mean", "running_var", "num_batches_tracked")
    assert sorted(targets) == sorted(f"{bn}.{b}" for bn in ("stem.1", "layer1.bn1", "layer1.bn2", "layer2.bn1",
                                                            "layer2.bn2", "layer2.down.1") for b in per_norm)
    buffers = {gi.name for gi in traced.inputs if gi.kind is NodeKind.BUFFER}
    assert all(u.placeholder in buffers for u in traced.buffer_updates)
    assert traced.out_spec.num_leaves == 1  # the logits only: new buffer values are not user outputs
    ops = {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert not {o for o in ops if "batch_norm" in o}, ops  # spelled in ops with sharding rules


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=str)
def test_batch_norm_training_matches_one_device_over_two_steps(resnet, mesh):
    model, traced = resnet
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_traced(traced, Mesh(mesh), Options(device=CHEAP_COMM))[1]
    if mesh == (2,):  # the batch split of some norm: its statistics come from partial means, all-reduced
        synced = [n for n in plan.nodes if n.op == "aten.mean.dim" and str(n.inputs[0]) == "S(0)"]
        assert synced and any(str(n.outputs[0]) == "P(avg)" for n in synced)
    before = {k: b.clone() for k, b in model.named_buffers()}
    assert simulate_sgd_steps(model, _batches(2), traced, plan, lr=0.1, context=f"TinyResNet on {mesh}") == 2
    for k, b in model.named_buffers():  # the simulator ran on copies
        torch.testing.assert_close(b, before[k], rtol=0, atol=0)


def test_a_wrong_buffer_update_is_caught_by_the_simulator(resnet):
    """The check itself: a reference whose statistics moved otherwise fails."""
    model, traced = resnet
    plan = plan_traced(traced, Mesh((2,)), Options(device=CHEAP_COMM))[1]
    other = TinyResNet(norm="batch").train()
    other.load_state_dict(model.state_dict())
    other.stem[1].momentum = 0.2  # the reference moves its running statistics further
    from autopar.tools.simulated import reference_run, simulate_against
    args, kwargs = _batches(1)[0]
    with pytest.raises(AssertionError, match="buffer stem.1.running_"):
        simulate_against(model, args, kwargs, traced, plan, reference_run(other, args, kwargs, training=True))


@pytest.mark.slow  # subprocesses or gloo ranks: in the full suite, out of the fast set
def test_batch_norm_training_on_gloo_ranks_matches_one_device():
    per_rank = [r[0] for r in run_ranks(2, [(cases.batch_norm_training, dict(mesh=(2,), steps=2))])]
    for rank, res in enumerate(per_rank):
        assert res["synced_means"] > 0  # some norm's statistics were synchronised over the batch split
        for step in range(2):
            got, want = res["outputs"][step]
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} step {step + 1} output: {m}")
            for name, (g, w, spec) in res["grads"][step].items():
                assert (g is None) == (w is None), f"rank {rank} step {step + 1} grad of {name} ({spec})"
                if w is not None:
                    torch.testing.assert_close(g, w, msg=lambda m: f"rank {rank} step {step + 1} grad {name}: {m}")
            full, ref = res["states"][step]
            assert full.keys() == ref.keys()
            for name in ref:
                torch.testing.assert_close(full[name], ref[name], msg=lambda m: f"rank {rank} step {step + 1} {name}: {m}")
        assert int(res["states"][1][0]["stem.1.num_batches_tracked"]) == 2
        for name, (got, want) in res["sharded_buffers"].items():
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} sharded state dict {name}: {m}")


class MixedNorms(torch.nn.Module):
    """A norm without running statistics beside ones with them (then every training batch
    norm is functionalised), and a BatchNorm1d over (N, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.plain = torch.nn.BatchNorm2d(4, track_running_stats=False)
        self.tracked = torch.nn.BatchNorm2d(4, momentum=0.3)
        self.head = torch.nn.Linear(4, 6)
        self.flat = torch.nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.tracked(torch.relu(self.plain(self.conv(x))))
        return self.flat(self.head(x.mean((2, 3))))


def test_norms_with_and_without_running_statistics_match_one_device():
    torch.manual_seed(0)
    model = MixedNorms().train()
    traced = trace(model, *_batches(1)[0])
    assert sorted(u.target.split(".")[0] for u in traced.buffer_updates) == ["flat"] * 3 + ["tracked"] * 3
    ops = {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert not {o for o in ops if "batch_norm" in o}, ops
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_traced(traced, Mesh((2,)), Options(device=CHEAP_COMM))[1]
    assert simulate_sgd_steps(model, _batches(2), traced, plan, lr=0.1, context="MixedNorms on (2,)") == 2
