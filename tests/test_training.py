"""Training through the parallel program on real gloo ranks: AdamW steps, clipping,
state dicts, sharded checkpoints, local inputs; and the plan shapes users know."""

from __future__ import annotations
from autopar.core.kinds import NodeKind

import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.cost_models import comm
from autopar.cost_models.devices import preset
from tests import cases
from tests.harness import run_ranks

FAMILIES = ["gpt2", "llama", "bert"]


@pytest.fixture(scope="module")
def four_rank_training():
    batch = [(cases.train_steps, dict(model=m, mesh=mesh)) for m in FAMILIES for mesh in [(2, 2), (1, 4), (4, 1)]]
    results = run_ranks(4, batch)
    return {(kw["model"], kw["mesh"]): [r[i] for r in results] for i, (_, kw) in enumerate(batch)}


@pytest.fixture(scope="module")
def eight_rank_training(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("dcp"))
    batch = [(cases.train_steps, dict(model=m, mesh=(2, 4))) for m in FAMILIES]
    batch.append((cases.training_utilities, dict(tmp=tmp)))
    results = run_ranks(8, batch)
    return [[r[i] for r in results] for i in range(len(batch))]


def _check_training(per_rank):
    """Losses at rtol 1e-5 (fp32) at every step; parameters after the last step at
    assert_close's fp32 defaults (rtol 1.3e-6, atol 1e-5). Adam divides by sqrt(v), so
    the last-bit differences of a reordered sum (sharded matmuls add in another order)
    move small-gradient updates a little (see the eps note in cases.train_steps)."""
    for rank, res in enumerate(per_rank):
        torch.testing.assert_close(res["losses"], res["ref_losses"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank} losses: {m}")
        for name, (got, want) in res["params"].items():
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.slow  # a 4-rank spawn of 9 training runs
@pytest.mark.parametrize("mesh", [(2, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("model", FAMILIES)
def test_adamw_steps_match_single_device(four_rank_training, model, mesh):
    _check_training(four_rank_training[(model, mesh)])


@pytest.mark.slow  # 8 ranks
@pytest.mark.parametrize("index", range(3), ids=FAMILIES)
def test_adamw_steps_match_on_2x4(eight_rank_training, index):
    _check_training(eight_rank_training[index])


@pytest.mark.slow  # 8 ranks
def test_clip_state_dict_checkpoint_and_local_inputs(eight_rank_training):
    for rank, res in enumerate(eight_rank_training[3]):
        torch.testing.assert_close(res["norm"], res["ref_norm"], rtol=1e-5, atol=1e-7)
        assert res["clipped"]
        for got, want in res["clipped"]:
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} clipped grad: {m}")
        for key in ("roundtrip", "loaded", "dcp", "local"):
            got, want = res[key]
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} {key}: {m}")
        assert set(res["input_specs"]) == {"kwargs['input_ids']", "kwargs['labels']"}


class RegressionMLP(nn.Module):
    """Returns only its loss, so the plan's outputs are one replicated scalar."""

    def __init__(self, widths):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return ((x - y) ** 2).mean()


def _train_plan(widths, batch, mesh):
    torch.manual_seed(0)
    model = RegressionMLP(widths).train()
    x, y = torch.randn(batch, widths[0]), torch.randn(batch, widths[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, (x, y), mesh=mesh)


def test_large_batch_on_8x1_trains_data_parallel():
    plan = _train_plan((64, 256, 64), batch=8192, mesh=(8, 1))
    params = [n for n in plan.nodes if n.kind is NodeKind.PARAMETER]
    assert all(n.outputs[0].is_replicated() for n in params)
    forward = plan.collectives()
    # the only forward communication is the scalar loss's reduction
    assert all(c.nbytes <= 8 and c.consumer == "output" for c in forward), forward
    syncs = [(e.producer, s) for e in plan.edges for s in e.steps if s.backward in ("all_reduce", "reduce_scatter")
             and s.kind in ("grad_sync", "all_gather")]
    assert sorted(p for p, _ in syncs) == sorted(n.name for n in params)  # one gradient all-reduce per parameter


def test_small_batch_wide_layers_on_1x8_trains_megatron():
    hidden = 4096
    plan = _train_plan((1024, hidden, 1024, hidden, 1024), batch=8, mesh=(1, 8))
    weights = [n for n in plan.nodes if n.kind is NodeKind.PARAMETER and n.outputs[0].meta.ndim == 2]
    assert [str(n.outputs[0]) for n in weights] == ["RS(0)", "RS(1)", "RS(0)", "RS(1)"]
    link = preset("cpu").intra_link
    act = 8 * 1024 * 4
    megatron_fwd = 2 * comm.all_reduce_s(act, 8, link)  # L/2 all-reduces
    fwd = sum(comm.all_reduce_s(c.nbytes, 8, link) if c.kind == "all_reduce" else
              comm.reduce_scatter_s(c.nbytes, 8, link) if c.kind == "reduce_scatter" else
              comm.all_gather_s(c.nbytes * 8, 8, link) for c in plan.collectives() if c.nbytes > 8)
    assert fwd <= megatron_fwd * (1 + 1e-9)
    # backward: Megatron's f all-reduces the input gradient of each column layer except the first
    assert plan.comm_s <= 2 * megatron_fwd * (1 + 1e-9) + 1e-4


def test_2x4_gives_a_hybrid():
    # on two H100 nodes of 4 (nodes=2) axis 0 crosses nodes (slow links), axis 1 stays
    # inside one: a large batch through wide layers is split by data across nodes and by
    # tensor inside them. Planned on the meta device: no weights or activations are allocated.
    with torch.device("meta"):
        model = RegressionMLP((4096, 16384, 4096)).train()
        x, y = torch.randn(32768, 4096), torch.randn(32768, 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(model, (x, y), mesh=(2, 4), device="h100", nodes=2)
    x = plan.node("input_0").outputs[0]
    weights = [n.outputs[0] for n in plan.nodes if n.kind is NodeKind.PARAMETER and n.outputs[0].meta.ndim == 2]
    assert x.placements[0] == autopar.Shard(0)  # data parallel across axis 0
    assert all(isinstance(w.placements[1], autopar.Shard) for w in weights)  # tensor parallel on axis 1


@pytest.mark.slow  # writes 128 MiB of weights; 4 ranks read their slices
def test_meta_model_loads_only_its_shards(tmp_path):
    from safetensors.torch import save_file
    from tests.models import MLP
    widths = (2048, 4096, 2048, 4096, 2048)  # 128 MiB of fp32 weights
    torch.manual_seed(0)
    full = MLP(widths, bias=False).eval()
    path = str(tmp_path / "model.safetensors")
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, path)
    model_bytes = sum(v.numel() * 4 for v in full.state_dict().values())
    x = torch.randn(1, widths[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = full(x)
    del full
    results = run_ranks(4, [(cases.meta_model_loads_its_shards, dict(path=path, widths=widths))])
    for rank, (res,) in enumerate(results):
        assert res["refused"] and "load_safetensors" in res["refused"]
        assert res["shard_bytes"] <= model_bytes // 2, "the plan should shard these weights"
        # peak anonymous memory while loading: about this rank's shards, far from the model
        assert res["peak_increase"] < res["shard_bytes"] + 16 * 2**20, (rank, res["peak_increase"], res["shard_bytes"])
        assert res["peak_increase"] < model_bytes // 2
        torch.testing.assert_close(res["out"], expected)


@pytest.mark.slow
def test_gradients_reduced_once_per_two_backwards_with_grad_sync_every():
    """Options.grad_sync_every=2 (what a pipeline stage runs with, its microbatches' count):
    after the first backward each rank holds only its own part (the ranks differ); the
    second reduces the sum of both, equal on every rank to one device's accumulated
    gradient; the next two add their reduction to it."""
    results = run_ranks(4, [(cases.deferred_data_parallel, dict())])
    for rank, (res,) in enumerate(results):
        assert res["replicated"] and res["deferred"] == 8, (res["replicated"], res["deferred"])
        assert [reductions for _, _, reductions in res["after"]] == [0, 1, 1, 2]
        for i in (1, 3):
            got, want, _ = res["after"][i]
            for name, g in got.items():
                torch.testing.assert_close(g, want[name], msg=lambda m: f"rank {rank}, backward {i + 1}, {name}: {m}")
                assert torch.equal(g, results[0][0]["after"][i][0][name]), f"rank {rank}'s {name} differs from rank 0's"
    firsts = [res["after"][0][0] for (res,) in results]
    assert any(not torch.equal(firsts[0][n], firsts[1][n]) for n in firsts[0]), "the first backward was reduced"


def test_data_parallel_gradients_are_bucketed_and_accumulate():
    results = run_ranks(4, [(cases.bucketed_data_parallel, dict())])
    for rank, (res,) in enumerate(results):
        # every parameter's sync left the program: one bucketed all-reduce after backward
        assert len(res["deferred"]) == 8 and all(axes == (0,) for _, axes in res["deferred"]), res["deferred"]
        assert "grad_sync" not in res["code"]
        # each bucket is summed in one buffer kept from backward to backward, as DDP's are
        assert res["same_buffers"] and all(res["same_buffers"]), res["same_buffers"]
        for name, (got, want) in res["grads"].items():
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} accumulated grad {name}: {m}")
            # replicas of a replicated parameter must stay bit-equal, or they drift apart over training
            assert torch.equal(got, results[0][0]["grads"][name][0]), f"rank {rank}'s {name} gradient differs from rank 0's"
        assert "did not accumulate into .grad (torch.autograd.grad?)" in res["refused"], res["refused"]
        torch.testing.assert_close(res["after"], results[0][0]["after"])
