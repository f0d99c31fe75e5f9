"""Uneven shards (issue #15): a dim of n on an axis of k that does not divide is cut as
torch.chunk cuts it (blocks of ceil(n / k), the last one short), and every program of
such a plan matches the single-device model.

1. Block sizes, fits, local shapes and block indices (pure); in whole heads (Shard.unit,
   S(d/u)) in tests/test_uneven_heads.py.
2. Which rules keep uneven shards: same-size dims yes; a view that merges or splits the
   dim only in whole units (rows of a sequence, heads); a mean (P(avg)), no.
3. In the mesh simulator: batch 3 on a 2-way axis (an MLP, and Llama's whole decoder),
   a vocabulary of 1001 on 4 ranks (GPT-2, Llama: embedding rows, LM head rows and
   logits), both at once on a (2, 2) mesh, an MLP with no even dim, Llama with 5 heads
   of 16 on 2 ranks split by head (its plan through a JSON file first), each node
   preferring an uneven strategy where it has one; outputs and every gradient. The
   solver picks uneven splits where no even one exists.
4. On real gloo ranks (one spawn of 2): the padded collectives; compiled uneven plans
   (batch 3 MLP and Llama, GPT-2 vocabulary 1001, odd MLP, Llama split in 3 + 2 heads):
   outputs, gradients, full_state_dict; load_full_state_dict, safetensors and DCP round
   trips with uneven parameter shards, blocks of whole heads too (DCP saves those whole).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings

import pytest
import torch

from autopar.core.kinds import StepKind
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.placement import (Partial, R, Shard, Spec, TensorMeta, block_index, chunk_sizes, local_chunk,
                                   no_empty_block, parse_placements)
from autopar.passes.plan.planning import plan_annotated
from autopar.passes.rules import expand, rule_for
from autopar.passes.rules.blockwise import op_call_of, run_sharded
from autopar.passes.strategies.strategies import AnnotatedGraph, annotate
from autopar.passes.trace.trace import trace
from autopar.tools import zoo
from autopar.tools.simulated import CHEAP_COMM, loss_of, simulate_against
from tests.harness import run_ranks
from tests.test_uneven_heads import head_split_weights, heads_state, in_heads, in_units, llama_heads5, through_json

aten = torch.ops.aten
F32 = torch.float32


# ---- 1. blocks -------------------------------------------------------------------------

@pytest.mark.parametrize("n,k,sizes", [(8, 4, (2, 2, 2, 2)), (3, 2, (2, 1)), (1001, 4, (251, 251, 251, 248)),
                                       (6, 4, (2, 2, 2, 0)), (50257, 8, (6283,) * 7 + (6276,))])
def test_chunk_sizes_follow_torch_chunk(n, k, sizes):
    assert chunk_sizes(n, k) == sizes
    got = [c.shape[0] for c in torch.empty(n).chunk(k)]
    assert tuple(got + [0] * (k - len(got))) == sizes
    assert no_empty_block(n, k) == (0 not in sizes)


def test_fits_allows_one_uneven_axis_without_empty_blocks():
    def spec(placements, shape):
        return Spec(placements, TensorMeta(shape, F32))
    assert not spec((Shard(0),), (3, 4)).fits((2,))
    assert spec((Shard(0),), (3, 4)).fits((2,), uneven=True)
    assert not spec((Shard(0),), (6, 4)).fits((4,), uneven=True)  # the last rank would hold nothing
    assert not spec((Shard(0), Shard(0)), (6, 4)).fits((2, 2), uneven=True)  # two axes on an uneven dim
    assert spec((Shard(0), Shard(0)), (8, 4)).fits((2, 2), uneven=True)  # even nesting as before
    s = spec((R, Shard(1)), (4, 1001))
    assert s.local_shape((2, 4)) == (4, 251)  # priced at the largest block
    assert [s.local_shape_at((2, 4), (0, c)) for c in range(4)] == [(4, 251)] * 3 + [(4, 248)]
    full = torch.arange(4 * 1001).view(4, 1001)
    for c in range(4):
        assert torch.equal(full[block_index(s, (2, 4), (1, c))], local_chunk(full, s, (2, 4), (1, c)))


def test_the_largest_block_sets_the_price():
    """Compute and memory are priced at ceil(n / k) rows, a gather at the padded bytes:
    3 rows on 2 ranks cost what 4 rows (2 per rank) cost."""
    from autopar.core.resharding import reshard_steps
    from autopar.cost_models.model import CostModel
    costs = CostModel.analytic("h100", (2,), training=True)

    def mm_cost(m):
        x, w, out = (TensorMeta((m, 512), F32), TensorMeta((512, 512), F32), TensorMeta((m, 512), F32))
        return costs.op_cost(aten.mm.default, (Spec((Shard(0),), x), Spec((R,), w)), (Spec((Shard(0),), out),))
    assert mm_cost(3).total_s == mm_cost(4).total_s > mm_cost(2).total_s

    def gather_s(m):
        meta = TensorMeta((m, 4096), F32)
        return costs.steps_cost(reshard_steps(Spec((Shard(0),), meta), Spec((R,), meta))).total_s
    assert gather_s(3) == gather_s(4) > gather_s(2)


# ---- 2. rules --------------------------------------------------------------------------

def _strategies(target, args, mesh=(2,)):
    call, _ = op_call_of(target, args, {})
    return call, expand(rule_for(target)(call), call, mesh, uneven=True)


def test_uneven_kept_where_exact_and_refused_where_not():
    x = torch.randn(3, 8, 5)
    _, views = _strategies(aten.view.default, (x, [24, 5]))
    # 3 rows of 8 merged into 24 are cut in whole rows of 8 (16, 8), never as chunk(24, 2)
    assert [str(s) for s in views if str(s.inputs[0]) == "S(0)"] == ["(S(0))->S(0/8)"]
    assert any(str(s.inputs[0]) == "S(2)" for s in views)  # the 5 columns survive whole
    # 7 heads of 8 over 4 ranks: blocks of 2, 2, 2, 1 heads are 16, 16, 16, 8 columns, not
    # chunks of 56 (14 each): the split into heads and the merge back go in whole heads
    _, heads = _strategies(aten.view.default, (torch.randn(2, 8, 56), [2, 8, 7, 8]), mesh=(4,))
    _, merged = _strategies(aten.view.default, (torch.randn(2, 8, 7, 8), [2, 8, 56]), mesh=(4,))
    assert {str(s) for s in heads + merged if any(sp.uneven_axes((4,)) for sp in s.inputs + s.outputs)} == {
        "(S(2/8))->S(2)", "(S(2))->S(2/8)"}
    assert any(str(s) == "(S(1))->S(1)" for s in heads)  # the sequence split (even) stays
    for s in views + heads + merged:  # each computes the view, shard by shard
        src, shape = (x, [24, 5]) if s in views else (torch.randn(*s.inputs[0].meta.shape),
                                                      list(s.outputs[0].meta.shape))
        mesh = (2,) if s in views else (4,)
        torch.testing.assert_close(run_sharded(aten.view.default, (src, shape), {}, s, mesh)[0], src.reshape(shape))
    _, means = _strategies(aten.mean.dim, (x, [0]))
    assert "(S(0))->P(avg)" not in {str(s) for s in means}  # the mean of unequal blocks' means is not the mean
    assert Partial("avg") in {s.outputs[0].placements[0] for s in means}  # an average input still passes
    _, sums = _strategies(aten.sum.dim_IntList, (x, [0]))
    assert any(str(s) == "(S(0))->P" for s in sums)
    call, mms = _strategies(aten.mm.default, (torch.randn(3, 5), torch.randn(5, 7)))
    uneven = [s for s in mms if any(sp.uneven_axes((2,)) for sp in s.inputs + s.outputs)]
    assert {str(s) for s in uneven} == {"(S(0),R)->S(0)", "(S(1),S(0))->P", "(R,S(1))->S(1)"}
    for s in uneven:  # each computes the op, shard by shard
        a, b = torch.randn(3, 5), torch.randn(5, 7)
        torch.testing.assert_close(run_sharded(aten.mm.default, (a, b), {}, s, (2,))[0], a @ b)


# ---- 3. simulator ----------------------------------------------------------------------

class OddMLP(torch.nn.Module):
    """No dim of it divides by 2: only uneven splits can shard it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(7, 5), torch.nn.Linear(5, 9)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def is_uneven(spec: Spec, mesh_shape: tuple[int, ...]) -> bool:
    return bool(spec.uneven_axes(mesh_shape))


def is_batch3(spec: Spec, mesh_shape: tuple[int, ...]) -> bool:
    return spec.meta.shape[:1] == (3,) and spec.placements[0] == Shard(0)


def prefer(graph: AnnotatedGraph, want=is_uneven) -> AnnotatedGraph:
    """Every node keeps only its strategies with a spec `want` likes, where it has any."""
    shape = graph.mesh.shape

    def keep(node):
        liked = tuple(s for s in node.strategies if any(want(sp, shape) for sp in s.inputs + s.outputs))
        return dataclasses.replace(node, strategies=liked or node.strategies)
    nodes = tuple(keep(n) for n in graph.nodes)
    return AnnotatedGraph(graph.traced, graph.mesh, nodes, graph.unruled_ops, graph.discovered_ops,
                          {n.name: n for n in nodes})


def uneven_plan(model, args, kwargs, mesh, want=is_uneven):
    """The plan with nearly free communication, every node preferring `want` (None: the solver's own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(model, args, kwargs)
        graph = annotate(traced, Mesh(mesh))
        plan = plan_annotated(prefer(graph, want) if want else graph, Options(device=CHEAP_COMM))
    return traced, plan


def uneven_nodes(plan) -> list[str]:
    return [n.name for n in plan.nodes if any(s.uneven_axes(plan.mesh.shape) for s in n.inputs + n.outputs)]


def odd_mlp():
    torch.manual_seed(0)
    return OddMLP(), (torch.randn(3, 7),), {}


def gpt2_vocab(vocab: int = 1001, batch: int = 2):
    return zoo.build("gpt2-tiny", batch=batch, seq=8, training=True, vocab_size=vocab)


CASES = {  # name: (build, mesh, which strategies each node prefers)
    "batch3-mlp-2": (odd_mlp, (2,), is_batch3),
    "odd-mlp-2": (odd_mlp, (2,), is_uneven),
    "gpt2-vocab1001-4": (gpt2_vocab, (4,), is_uneven),
    "llama-batch3-2": (lambda: zoo.build("llama-tiny", batch=3, seq=8, training=True), (2,), is_batch3),
    "llama-batch3-vocab1001-2x2": (lambda: zoo.build("llama-tiny", batch=3, seq=8, training=True, vocab_size=1001),
                                   (2, 2), is_uneven),
    "llama-vocab1001-4": (lambda: zoo.build("llama-tiny", batch=2, seq=8, training=True, vocab_size=1001), (4,),
                          is_uneven),
    "llama-heads5-2": (llama_heads5, (2,), in_heads),
    "llama-heads5-reshard-2": (llama_heads5, (2,), in_units),
}


# the fast set keeps the 1-D Llama cases
SLOW_SIMULATED = {"gpt2-vocab1001-4", "llama-batch3-vocab1001-2x2", "llama-heads5-reshard-2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SIMULATED else n
                                  for n in sorted(CASES)])
def test_uneven_plan_matches_single_device_in_simulation(name):
    build, mesh, want = CASES[name]
    model, args, kwargs = build()
    traced, plan = uneven_plan(model, args, kwargs, mesh, want)
    assert uneven_nodes(plan), f"{name}: no uneven shard in the plan"
    if want is is_batch3:
        assert all(str(n.outputs[0]) == "S(0)" for n in plan.nodes if n.name in ("input_0", "linear", "relu"))
    if "vocab" in name:  # the vocabulary itself is split: embedding rows, LM head rows or logits
        assert any(s.uneven_axes(mesh) and 1001 in s.meta.shape for n in plan.nodes for s in n.inputs + n.outputs)
    if name == "llama-heads5-2":  # q, k, v, o projections cut in whole heads; attention on 3 and 2 heads
        assert len(head_split_weights(plan)) == 4, head_split_weights(plan)
        assert all(str(n.outputs[0]) == "S(1)" for n in plan.nodes if "attention" in n.op)
    if name == "llama-heads5-reshard-2":  # partial sums scattered into whole heads (padded)
        kinds = {s.kind for e in plan.edges for s in e.steps if 16 in (s.unit, s.from_unit)}
        assert StepKind.REDUCE_SCATTER in kinds, kinds
    if "heads" in name:  # a plan file does not keep the steps' units: the rewrite reads them off the specs
        digest = plan.digest()
        plan = through_json(plan)
        assert plan.digest() == digest  # every rank agrees, whether it planned or read the file
    compared = simulate_against(model, args, kwargs, traced, plan, context=f"{name} on {mesh}")
    assert compared > 0


def test_solver_splits_unevenly_where_no_even_split_exists():
    model, args, kwargs = odd_mlp()
    traced, plan = uneven_plan(model, args, kwargs, (2,), want=None)
    assert uneven_nodes(plan), "the solver left a model with only uneven splits replicated"
    simulate_against(model, args, kwargs, traced, plan, context="odd MLP, solver's plan")


def test_a_plan_with_an_unservable_split_is_refused_by_name():
    """A hand-edited plan that cuts 6 rows over 4 ranks (the last would hold none) is a
    PlanFileError naming the node, not a program with wrong blocks."""
    from autopar.core.errors import PlanFileError
    from autopar.passes.lower.rewrite import rewrite
    torch.manual_seed(0)
    model, x = OddMLP(), torch.randn(6, 7)
    traced, plan = uneven_plan(model, (x,), {}, (4,), want=None)
    bad = Spec((Shard(0),), TensorMeta((6, 7), F32))
    nodes = tuple(dataclasses.replace(n, outputs=(bad,)) if n.name == "input_0" else n for n in plan.nodes)
    with pytest.raises(PlanFileError, match=r"input_0 .*\(6, 7\) as S\(0\) on mesh \(4,\)"):
        rewrite(traced, dataclasses.replace(plan, nodes=nodes), coords=(0,))


# ---- 4. gloo ranks -----------------------------------------------------------------------

def padded_collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from autopar.core.kinds import StepKind
    from autopar.runtime.collectives import AxisComm, Move, all_gather, all_to_all, move, reduce_scatter
    group = dist.group.WORLD
    comm = AxisComm(group, world, rank, group.group_name)
    full = torch.arange(5 * 3, dtype=F32).view(5, 3)
    mine = full.chunk(world, dim=0)[rank]
    gathered = all_gather(mine.t().contiguous(), 1, comm, size=5)  # a dim-1 gather of 3, 2 columns
    scattered = reduce_scatter(full * (rank + 1), 0, comm)  # rows 3 and 2 of the sum
    moved = all_to_all(mine, 0, 1, comm, size=5)  # rows 3/2 -> columns 2/1
    heads = torch.arange(80, dtype=F32).view(1, 80)  # 5 heads of 16: 48 and 32 columns
    mine_heads = heads[:, (0, 48)[rank]:(48, 80)[rank]]
    heads_gathered = all_gather(mine_heads, 1, comm, size=80, unit=16)
    heads_scattered = move(Move(StepKind.REDUCE_SCATTER, 0, size=80, unit=16), heads[0] * (rank + 1), comm)
    return {"gathered": gathered, "scattered": scattered, "moved": moved, "heads_gathered": heads_gathered,
            "heads_scattered": heads_scattered}


def compiled_uneven(rank: int, world: int, which: str) -> dict:
    import autopar
    from autopar.runtime.state import full_state_dict
    build, _, want = CASES[which]
    model, args, kwargs = build()
    _, plan = uneven_plan(model, args, kwargs, (world,), want)
    pm = autopar.compile(model, args, kwargs, mesh=(world,), plan=plan)
    out = pm(*args, **kwargs)
    loss_of(out).backward()
    grads = {n: (t.grad.clone(), str(pm.state_specs[n])) for n, t in pm.state_tensors.items()
             if isinstance(t, torch.nn.Parameter) and t.grad is not None}
    result = {"out": out if isinstance(out, torch.Tensor) else out.logits.detach(), "grads": grads,
              "uneven": uneven_nodes(plan), "coords": pm.coords}
    result["full"] = full_state_dict(pm)
    if which == "odd-mlp-2":
        result.update(_state_round_trips(pm, rank))
    if which == "llama-heads5-2":
        result.update(heads_state(pm, rank))
    return result


def _state_round_trips(pm, rank: int) -> dict:
    """load_full_state_dict, safetensors and DCP with the uneven parameter shards."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from autopar.runtime.resume import resume, save_training_checkpoint
    from autopar.runtime.state import full_state_dict
    shifted = {k: v + 1 for k, v in full_state_dict(pm).items()}
    pm.load_full_state_dict(shifted)
    after_load = full_state_dict(pm)
    tmp = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(tmp)
    path = os.path.join(tmp[0], "m.safetensors")
    if rank == 0:
        save_file({k: v * 2 for k, v in shifted.items()}, path)
    dist.barrier()
    pm.load_safetensors(path)
    after_safetensors = full_state_dict(pm)
    pm.save_checkpoint(os.path.join(tmp[0], "ckpt"))
    pm.load_full_state_dict({k: torch.zeros_like(v) for k, v in shifted.items()})
    pm.load_checkpoint(os.path.join(tmp[0], "ckpt"))
    after_dcp = full_state_dict(pm)
    # optimiser state of uneven shards through a training checkpoint
    opt = torch.optim.Adam(pm.parameters(), lr=0.01)
    (x,), _ = odd_mlp()[1:]
    loss_of(pm(x)).backward()
    opt.step()
    saved = {k: v.clone() for k, v in full_state_dict(pm).items()}
    moments = [opt.state[p]["exp_avg"].clone() for p in pm.parameters()]
    save_training_checkpoint(pm, opt, os.path.join(tmp[0], "train"), step=1)
    loss_of(pm(x)).backward()
    opt.step()  # moves the weights and moments on; resume must bring both back
    resume(pm, opt, os.path.join(tmp[0], "train"))
    return {"shifted": shifted, "after_load": after_load, "after_safetensors": after_safetensors,
            "after_dcp": after_dcp, "specs": {k: str(s) for k, s in pm.state_specs.items()},
            "saved": saved, "resumed": full_state_dict(pm),
            "moments_equal": all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(pm.parameters(), moments))}


def _reference(which: str):
    build, _, _ = CASES[which]
    model, args, kwargs = build()
    out = model(*args, **kwargs)
    loss_of(out).backward()
    return model, (out if isinstance(out, torch.Tensor) else out.logits).detach()


@pytest.mark.slow
def test_uneven_shards_on_gloo_ranks():
    world = 2
    results = run_ranks(world, [(padded_collectives, {}), (compiled_uneven, {"which": "batch3-mlp-2"}),
                                (compiled_uneven, {"which": "odd-mlp-2"}),
                                (compiled_uneven, {"which": "gpt2-vocab1001-4"}),
                                (compiled_uneven, {"which": "llama-batch3-2"}),
                                (compiled_uneven, {"which": "llama-heads5-2"})])
    full = torch.arange(5 * 3, dtype=F32).view(5, 3)
    for rank, (coll, batch3, mlp, gpt, llama, heads) in enumerate(results):
        torch.testing.assert_close(coll["heads_gathered"], torch.arange(80, dtype=F32).view(1, 80))
        heads_sum = torch.arange(80, dtype=F32) * 3  # 3 heads of 16 on rank 0, 2 on rank 1
        torch.testing.assert_close(coll["heads_scattered"], heads_sum[(0, 48)[rank]:(48, 80)[rank]])
        assert heads["local_q"] == ((48, 32)[rank], 80)  # 3 heads of 16, then 2
        for k, v in heads["after_safetensors"].items():
            torch.testing.assert_close(heads["after_dcp"][k], v, msg=f"rank {rank}: {k} through a DCP checkpoint")
        for k, v in heads["saved"].items():
            torch.testing.assert_close(heads["resumed"][k], v, rtol=0, atol=0, msg=f"rank {rank}: {k} resumed")
        assert heads["moments_equal"]
        for k, v in heads["shifted"].items():
            torch.testing.assert_close(heads["after_load"][k], v, msg=f"rank {rank}: {k} after load_full_state_dict")
            torch.testing.assert_close(heads["after_safetensors"][k], v * 2, msg=f"rank {rank}: {k} from safetensors")
        torch.testing.assert_close(coll["gathered"], full.t())
        torch.testing.assert_close(coll["scattered"], (full * 3).chunk(world)[rank])
        torch.testing.assert_close(coll["moved"], full.chunk(world, dim=1)[rank])
        for which, got in (("batch3-mlp-2", batch3), ("odd-mlp-2", mlp), ("gpt2-vocab1001-4", gpt),
                           ("llama-batch3-2", llama), ("llama-heads5-2", heads)):
            assert got["uneven"], f"{which}: the plan has no uneven shard"
            model, want = _reference(which)
            torch.testing.assert_close(got["out"], want, msg=f"{which} rank {rank} output")
            params = dict(model.named_parameters(remove_duplicate=False))
            for name, (grad, spec) in got["grads"].items():
                s = Spec(parse_placements(spec), TensorMeta(tuple(params[name].shape), F32))
                want_grad = local_chunk(params[name].grad, s, (world,), got["coords"])
                torch.testing.assert_close(grad, want_grad, msg=f"{which} rank {rank} gradient of {name} ({spec})")
            for k, v in model.state_dict().items():
                torch.testing.assert_close(got["full"][k], v, msg=f"{which} full_state_dict {k}")
        assert any(s != "R" for s in mlp["specs"].values()), mlp["specs"]
        for k, v in mlp["shifted"].items():
            torch.testing.assert_close(mlp["after_load"][k], v)
            torch.testing.assert_close(mlp["after_safetensors"][k], v * 2)
            torch.testing.assert_close(mlp["after_dcp"][k], v * 2)
            torch.testing.assert_close(mlp["resumed"][k], mlp["saved"][k])
        assert mlp["moments_equal"]
