"""Symbolic batch and sequence (Options.dynamic): one trace and one plan serve a range of
sizes, each equal to the single-device model; sizes outside the range or that a split
does not divide re-plan with one warning (or raise); a model that fixes a symbolic dim
is a clear error.

Tolerances are those of tests/test_equivalence.py: torch.testing.assert_close's fp32
defaults (rtol 1.3e-6, atol 1e-5) for outputs, losses and gradients."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.core.dynamic import DimName, Dynamic, OutOfRange
from autopar.core.errors import InputMismatchError, OptionsError, TraceError
from autopar.core.kinds import NodeKind
from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.core.placement import Shard
from autopar.passes.trace import dynamic as D
from autopar.passes.plan.planning import plan_traced
from autopar.passes.lower.simulate_mesh import simulate
from autopar.passes.trace.trace import flatten_inputs, trace
from autopar.passes.plan.dynamic_plans import DynamicReplanWarning
from autopar.tools.simulated import CHEAP_COMM
from tests import models
from tests.harness import run_ranks

# the brief's tiny models: 2 layers, hidden 64
WIDE = {"gpt2": dict(n_embd=64), "llama": dict(hidden_size=64, intermediate_size=128, head_dim=16)}
BATCHES = [(2, 8), (4, 8), (6, 8)]  # three batch sizes at one sequence length
SEQS = [(4, 4), (4, 12), (4, 16)]  # three sequence lengths at one batch size
RANGES = Dynamic(batch=(2, 16), seq=(4, 32))


def _outputs(out) -> list[torch.Tensor]:
    return [out.loss, out.logits]


# ---- offline: every rank's program in one process (passes/lower/simulate_mesh.py) ------------
def _traced(family: str, batch: int = 4, seq: int = 8):
    m = models.build(family, **WIDE[family])
    args, kwargs = models.inputs(family, batch, seq)
    tensors, _, _ = flatten_inputs(args, kwargs)
    marked = D.marked_dims(tensors, RANGES)
    shapes = D.export_shapes(tensors, marked, {DimName.BATCH: RANGES.batch, DimName.SEQ: RANGES.seq})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return m, trace(m, args, kwargs, dynamic_shapes=shapes)


# the inputs split by batch on axis 0 and by sequence on axis 1: every sym_size the
# program reads is of a split dim (the solver alone keeps these tiny inputs replicated)
SPLIT_INPUTS = {0: (Shard(0), Shard(1)), 1: (Shard(0), Shard(1))}


@pytest.mark.parametrize("family,mesh,pinned", [("gpt2", (2, 2), SPLIT_INPUTS), ("llama", (2, 2), None),
                                                pytest.param("llama", (2, 2), SPLIT_INPUTS, marks=pytest.mark.slow),
                                                pytest.param("llama", (4,), None, marks=pytest.mark.slow)])
def test_one_plan_serves_many_sizes_offline(family, mesh, pinned):
    """Plan once at (4, 8); the same rank programs at other sizes equal the model, and the
    signature refuses exactly the sizes a split does not divide."""
    m, traced = _traced(family)
    assert {s.name for s in traced.symbolic} == {DimName.BATCH, DimName.SEQ}
    assert {(s.lo, s.hi, s.hint) for s in traced.symbolic} == {(2, 16, 4), (4, 32, 8)}
    _, plan = plan_traced(traced, Mesh.of(mesh), Options(device=CHEAP_COMM), pinned)
    if pinned:
        assert [str(n) for n in plan.nodes if n.kind is NodeKind.USER_INPUT] == ["input_0: () -> S(0)S(1)",
                                                                                 "input_1: () -> S(0)S(1)"]
    divs = D.divisors(traced.gm, plan)
    assert divs, "the cheap-communication plan splits a symbolic dim"
    tensors, spec, consts = flatten_inputs(*models.inputs(family, 4, 8))
    signature = D.DynamicSignature.of((str(spec), repr(consts)), tensors, traced.symbolic, divs)
    state = {**dict(m.named_parameters(remove_duplicate=False)), **dict(m.named_buffers())}
    served = 0
    for b, s in [(4, 8), (8, 4), (12, 16), (8, 12), (4, 7), (3, 8), (20, 8)]:
        args, kwargs = models.inputs(family, b, s)
        ts, sp, cs = flatten_inputs(args, kwargs)
        refusal = signature.refusal((str(sp), repr(cs)), ts)
        if b == 20:
            assert refusal.kind is D.RefusalKind.OUT_OF_RANGE and "[2, 16]" in refusal.reason
        if b == 3:  # every plan here splits the batch somewhere
            assert refusal.kind is D.RefusalKind.INDIVISIBLE and "size s95 = 3" in refusal.reason
        if refusal is not None:
            continue
        served += 1
        with torch.no_grad():
            want = _outputs(m(*args, **kwargs))
            outs, _, _ = simulate(traced, plan, state, ts)
        for r, got in enumerate(outs):
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, msg=lambda msg: f"{family} {mesh} ({b}, {s}) rank {r}: {msg}")
    assert served >= 3


class FixedBatch(nn.Module):
    """Reshapes its input to a batch of 4: a symbolic batch is specialised."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.reshape(4, 16))


def test_specialised_dim_is_a_clear_error():
    x = torch.randn(4, 16)
    marked = D.marked_dims([x], Dynamic())
    shapes = D.export_shapes([x], marked, {DimName.BATCH: (2, 64)})
    with pytest.raises(TraceError, match=r"specialises the symbolic dim\(s\) batch \(batch in \[2, 64\]\)"):
        trace(FixedBatch(), (x,), dynamic_shapes=shapes)


def test_dynamic_options_are_checked():
    with pytest.raises(OptionsError, match="Dynamic.batch"):
        Dynamic(batch=(8, 2))
    with pytest.raises(OptionsError, match="Options.dynamic"):
        Options(dynamic="yes")
    assert Dynamic.of(True) == Dynamic() and Dynamic.of(False) is None


def test_marked_dims_rule():
    ids, emb = torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, 4)
    assert D.marked_dims([ids, emb], Dynamic()) == {(0, 0): DimName.BATCH, (0, 1): DimName.SEQ,
                                                    (1, 0): DimName.BATCH}
    assert D.marked_dims([ids], Dynamic(seq=None)) == {(0, 0): DimName.BATCH}
    assert D.marked_dims([torch.zeros(1, 8, dtype=torch.long)], Dynamic()) == {(0, 1): DimName.SEQ}
    positions = torch.zeros(1, 8, dtype=torch.long)  # broadcast over the batch: its dim 0 stays static
    assert D.marked_dims([ids, positions], Dynamic()) == {(0, 0): DimName.BATCH, (0, 1): DimName.SEQ,
                                                          (1, 1): DimName.SEQ}


# ---- on gloo ranks ----------------------------------------------------------------------
def dynamic_calls(rank: int, world: int, family: str, mesh: tuple, sizes: list, training: bool = False) -> dict:
    """One ParallelModule with dynamic=RANGES called at every size; each output (and in
    training the loss and every parameter gradient) next to the single-device one."""
    from tests.cases import _grad_pairs
    m = models.build(family, **WIDE[family])
    m.train(training)
    ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, mesh=mesh, device=CHEAP_COMM, dynamic=RANGES)
    pairs = []
    for b, s in sizes:
        args, kwargs = models.inputs(family, b, s)
        if training:
            ref.zero_grad()
            pm.zero_grad()
            want = ref(*args, **kwargs).loss
            want.backward()
            got = pm(*args, **kwargs).loss
            got.backward()
            grads = _grad_pairs(pm, {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False)}, rank)
            pairs.append(((b, s), [got.detach()], [want.detach()], grads))
        else:
            with torch.no_grad():
                pairs.append(((b, s), _outputs(pm(*args, **kwargs)), _outputs(ref(*args, **kwargs)), {}))
    return {"pairs": pairs, "traces": pm.trace_count, "solves": pm.solve_count, "plans": [str(p) for p in pm.plans]}


def replans(rank: int, world: int, book: str) -> dict:
    """A size a split does not divide, and one outside the range: one warning each and a
    new plan; with OutOfRange.RAISE the outside size is an InputMismatchError. Then the
    module's book of its four plans, saved to `book`, serves a new module's same calls
    without a solve."""
    m = models.build("gpt2", **WIDE["gpt2"])
    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, mesh=(world,), device=CHEAP_COMM, dynamic=RANGES)
        strict = autopar.compile(m, mesh=(world,), device=CHEAP_COMM, dynamic=Dynamic(
            batch=(2, 8), seq=(4, 32), plan_at=(8, 16), out_of_range=OutOfRange.RAISE))
    for b, s in [(4, 8), (3, 8), (20, 8), (1, 8), (4, 8)]:
        args, kwargs = models.inputs("gpt2", b, s)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            got = _outputs(pm(*args, **kwargs))
        out[(b, s)] = ([str(w.message) for w in caught if issubclass(w.category, DynamicReplanWarning)],
                       got, _outputs(m(*args, **kwargs)), pm.trace_count)
    with torch.no_grad():
        args, kwargs = models.inputs("gpt2", 4, 8)
        out["plan_at"] = (_outputs(strict(*args, **kwargs)), _outputs(m(*args, **kwargs)), strict.trace_count)
        try:
            args, kwargs = models.inputs("gpt2", 12, 8)
            strict(*args, **kwargs)
            out["raised"] = None
        except InputMismatchError as e:
            out["raised"] = str(e)
    out["plans"] = [str(p) for p in pm.plans]
    out["strict_plans"] = [str(p) for p in strict.plans]
    out["from_book"] = _from_book(pm, book, rank)
    return out


def _from_book(pm, path: str, rank: int) -> dict:
    if rank == 0:
        pm.plan_book.to_json(path)
    torch.distributed.barrier()
    m = models.build("gpt2", **WIDE["gpt2"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = autopar.compile(m, mesh=(pm.mesh.size,), device=CHEAP_COMM, dynamic=RANGES, plan=path)
        pairs = []
        for b, s in [(4, 8), (3, 8), (20, 8), (1, 8)]:
            args, kwargs = models.inputs("gpt2", b, s)
            with torch.no_grad():
                pairs.append(((b, s), _outputs(again(*args, **kwargs)), _outputs(m(*args, **kwargs)), {}))
    return {"pairs": pairs, "solves": again.solve_count, "traces": again.trace_count,
            "book": [p.fingerprint for p in autopar.PlanBook.from_json(path).plans],
            "ran": [p.fingerprint for p in again.plan_book.plans]}


def from_plan_file(rank: int, world: int, path: str, mesh: "tuple | None" = None,
                   sizes: tuple = ((4, 8), (6, 12), (2, 4)), local: tuple = (8, 12)) -> dict:
    """A dynamic plan made offline (autopar.plan(..., dynamic=...)) and saved, run through
    compile(plan=path) on `mesh` (default (world,)) at `sizes`, and at `local` with each
    rank's block: no solve on any rank, one trace, every size equal."""
    m = models.build("gpt2", **WIDE["gpt2"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, mesh=mesh or (world,), device=CHEAP_COMM, dynamic=RANGES, plan=path)
    pairs = []
    for b, s in sizes:
        args, kwargs = models.inputs("gpt2", b, s)
        with torch.no_grad():
            pairs.append(((b, s), _outputs(pm(*args, **kwargs)), _outputs(m(*args, **kwargs)), {}))
    args, kwargs = models.inputs("gpt2", *local)  # each rank passes its block, at a size not called yet
    local_args, local_kwargs = pm.shard_inputs(*args, **kwargs)
    with torch.no_grad():
        pairs.append(("local", _outputs(pm(*local_args, local_inputs=True, **local_kwargs)),
                      _outputs(m(*args, **kwargs)), {}))
    return {"pairs": pairs, "traces": pm.trace_count, "solves": pm.solve_count, "plans": [str(p) for p in pm.plans]}


def _check_pairs(res: dict, rank: int) -> None:
    for size, got, want, grads in res["pairs"]:
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, msg=lambda m: f"rank {rank} size {size}: {m}")
        for name, (g, w, spec) in grads.items():
            torch.testing.assert_close(g, w, msg=lambda m: f"rank {rank} size {size} grad {name} ({spec}): {m}")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dynamic") / "plan.json")
    args, kwargs = models.inputs("gpt2", 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autopar.plan(models.build("gpt2", **WIDE["gpt2"]), args, kwargs, mesh=(2,), device=CHEAP_COMM,
                     dynamic=RANGES).to_json(path)
    batch = [(from_plan_file, dict(path=path)),(dynamic_calls, dict(family="gpt2", mesh=(2,), sizes=BATCHES + SEQS)),
             (dynamic_calls, dict(family="llama", mesh=(2,), sizes=BATCHES + SEQS)),
             (dynamic_calls, dict(family="gpt2", mesh=(2,), sizes=[(4, 8), (2, 12), (6, 4)], training=True)),
             (replans, dict(book=str(tmp_path_factory.mktemp("dynamic") / "book.json")))]
    return run_ranks(2, batch)


@pytest.mark.slow  # one 2-rank spawn for the three (24 s); the offline tests above stay quick
@pytest.mark.parametrize("index,family", [(1, "gpt2"), (2, "llama"), (3, "gpt2-training")])
def test_one_trace_one_solve_for_three_batches_and_three_lengths(two_ranks, index, family):
    for rank, results in enumerate(two_ranks):
        res = results[index]
        _check_pairs(res, rank)
        assert res["traces"] == 1, res["plans"]
        assert res["solves"] == (1 if rank == 0 else 0)
        assert len(res["plans"]) == 1 and "batch" in res["plans"][0] and "seq" in res["plans"][0]


@pytest.mark.slow  # one 2-rank spawn for the three (24 s); the offline tests above stay quick
def test_offline_dynamic_plan_file_runs_every_size(two_ranks):
    for rank, results in enumerate(two_ranks):
        res = results[0]
        _check_pairs(res, rank)
        assert (res["traces"], res["solves"], len(res["plans"])) == (1, 0, 1)


@pytest.mark.slow  # one 2-rank spawn for the three (24 s); the offline tests above stay quick
def test_out_of_range_and_indivisible_sizes_replan_once(two_ranks):
    for rank, results in enumerate(two_ranks):
        res = results[4]
        for size in [(4, 8), (3, 8), (20, 8), (1, 8), (4, 8)]:
            _, got, want, _ = res[size]
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, msg=lambda m: f"rank {rank} size {size}: {m}")
        assert res[(4, 8)][0] == [] and res[(4, 8)][3] == 4  # the first plan still serves (4, 8)
        (indivisible,), traces = res[(3, 8)][0], res[(3, 8)][3]
        assert "2 ways" in indivisible and traces == 2
        (outside,), traces = res[(20, 8)][0], res[(20, 8)][3]
        assert "batch size (dim 0 of kwargs['input_ids']) is 20, outside the planned range [2, 16]" in outside
        assert traces == 3
        (one,), traces = res[(1, 8)][0], res[(1, 8)][3]  # a batch of 1: a plan with the batch static
        assert "is 1, outside the planned range [2, 16]" in one and traces == 4 and "input_ids'] [1, seq]" in res["plans"][3]
        assert res["raised"] and "batch size 12" in res["raised"] and "[2, 8]" in res["raised"]
        assert len(res["plans"]) == 4

        got, want, traces = res["plan_at"]  # priced at (8, 16), called at (4, 8)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, msg=lambda m: f"rank {rank} plan_at: {m}")
        assert traces == 1 and len(res["strict_plans"]) == 1
        assert "batch (s" in res["strict_plans"][0] and "in [2, 8], planned at 8" in res["strict_plans"][0]
        assert "in [4, 32], planned at 16" in res["strict_plans"][0]


@pytest.mark.slow  # the same 2-rank spawn
def test_a_dynamic_modules_plan_book_serves_every_range_without_a_solve(two_ranks):
    for rank, results in enumerate(two_ranks):
        res = results[4]["from_book"]
        _check_pairs(res, rank)
        assert len(res["book"]) == 4 and res["ran"] == res["book"], res
        assert (res["solves"], res["traces"]) == (0, 4), res


def test_causal_rows_split_follow_the_length_of_each_call():
    # context parallelism in a plan of symbolic length: each rank's causal mask starts
    # where its rows start in this call (blocks of 2 at 8 tokens, of 3 at 12), not where
    # they started at the size planned for
    from autopar.core.placement import R
    from autopar.passes.strategies.strategies import OpOutput
    m = models.build("causal", positions=64)
    args, kwargs = models.inputs("causal", 4, 8)
    tensors, _, _ = flatten_inputs(args, kwargs)
    shapes = D.export_shapes(tensors, D.marked_dims(tensors, RANGES), {DimName.BATCH: RANGES.batch,
                                                                      DimName.SEQ: RANGES.seq})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(m, args, kwargs, dynamic_shapes=shapes)
    rows = {OpOutput(n.name): (R, Shard(2)) for n in traced.gm.graph.nodes if "scaled_dot" in str(n.target)}
    assert len(rows) == 2
    _, plan = plan_traced(traced, Mesh.of((1, 4)), Options(device=CHEAP_COMM), {0: (R, Shard(1)), 1: (R, Shard(1)),
                                                                                **rows})
    state = dict(m.named_parameters(remove_duplicate=False))
    for b, s in [(4, 8), (4, 12), (2, 16)]:
        args, kwargs = models.inputs("causal", b, s)
        with torch.no_grad():
            want = m(*args, **kwargs)
            outs, _, _ = simulate(traced, plan, state, flatten_inputs(args, kwargs)[0])
        for r, got in enumerate(outs):
            torch.testing.assert_close(got[0], want, msg=lambda msg: f"({b}, {s}) rank {r}: {msg}")
