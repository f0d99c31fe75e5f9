"""Rank 0 traces and every other rank rebuilds its graph (autopar/runtime/shipping.py):
a model whose Python builds its graph in a per-process order (a set's order follows
PYTHONHASHSEED) plans and runs; other inputs on one rank, or a model rank 0 cannot
trace, is one error on every rank."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.passes.trace.program_bytes import load_program, program_bytes
from autopar.passes.trace.trace import export_program, trace, traced_program
from tests import models
from tests.harness import plain_env, run_processes, run_ranks

NAMES = ("q", "k", "v", "gate", "up", "down")


class PerProcessOrder(nn.Module):
    """Runs its branches in an order the process decides (`order`), then concatenates
    them by name (`sum=False`: the value and the wiring are the same in every process,
    the traced op order is not) or adds them up in that order (`sum=True`: the wiring
    differs too, the value only by rounding)."""

    def __init__(self, order, sum: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.order, self.sum = order, sum
        self.branches = nn.ModuleDict({n: nn.Linear(16, 8) for n in NAMES})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = {}
        for name in self.order():
            outs[name] = torch.relu(self.branches[name](x))
        if self.sum:
            total = outs.pop(next(iter(outs)))
            for y in outs.values():
                total = total + y
            return total
        return torch.cat([outs[n] for n in NAMES], dim=-1)


def _rotated_by_rank() -> list[str]:
    r = dist.get_rank() if dist.is_initialized() else 0
    return sorted(NAMES, key=lambda n: (NAMES.index(n) + r) % len(NAMES))


def _as_a_set() -> set[str]:
    return set(NAMES)  # iteration order follows this process's PYTHONHASHSEED


def _caught(fn) -> dict:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except Exception as e:  # noqa: BLE001 - what the test inspects
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


# ---- cases run on every gloo rank (module level: the spawned ranks import them) ----------

def rank_ordered_model(rank: int, world: int, sum: bool = False) -> dict:
    model = PerProcessOrder(_rotated_by_rank, sum).eval()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, (x,), mesh=(world,))
    own = trace(model, (x,))  # what this rank alone traces
    with torch.no_grad():
        return {"out": pm(x), "want": model(x), "fingerprint": pm.plan.fingerprint, "own": own.fingerprint}


def other_inputs_on_one_rank(rank: int, world: int) -> dict:
    x = torch.randn(6 if rank == 1 else 4, 16)
    return _caught(lambda: autopar.compile(models.build("mlp"), (x,), mesh=(world,)))


class Untraceable(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent Python control flow: torch.export refuses it
            return x
        return -x


def rank0_cannot_trace(rank: int, world: int) -> dict:
    return _caught(lambda: autopar.compile(Untraceable(), (torch.randn(4, 16),), mesh=(world,)))


def test_rank0_traces_and_the_other_ranks_rebuild_its_graph():
    results = run_ranks(2, [(rank_ordered_model, {}), (rank_ordered_model, {"sum": True}),
                            (other_inputs_on_one_rank, {}), (rank0_cannot_trace, {})])
    (ordered0, summed0, other0, fail0), (ordered1, summed1, other1, fail1) = results
    # 1. ops recorded in another order on each rank: the canonical form is one graph
    assert ordered0["own"] == ordered1["own"] == ordered0["fingerprint"] == ordered1["fingerprint"]
    # ... and where the wiring itself differs by rank, both run rank 0's graph
    assert summed0["own"] != summed1["own"], "the model must trace differently on each rank"
    assert summed0["fingerprint"] == summed1["fingerprint"] == summed0["own"]
    for res in (ordered0, ordered1, summed0, summed1):
        torch.testing.assert_close(res["out"], res["want"])
    # 2. rank 1's other input shape: one error type on every rank, naming rank and input
    for res in (other0, other1):
        assert res["type"] == "FingerprintMismatchError", res
        assert "rank 1" in res["message"] and "args[0]" in res["message"] and "[6, 16]" in res["message"], res
    # 3. rank 0 cannot trace: every rank raises its error type
    assert fail0["type"] == fail1["type"] == "TraceError", (fail0, fail1)


def test_a_program_round_trips_without_its_weights():
    model = models.build("llama", vocab_size=8192)  # 2 MiB of embedding and head
    args, kwargs = models.inputs("llama")
    want = trace(model, args, kwargs)
    data = program_bytes(export_program(model, args, kwargs))
    assert len(data) < sum(p.numel() * p.element_size() for p in model.parameters()) / 2  # no weights inside
    program = load_program(data)
    assert {t.device.type for t in program.state_dict.values()} == {"meta"}
    rebuilt = traced_program(program, model, args, kwargs)
    assert rebuilt.fingerprint == want.fingerprint
    assert [gi.name for gi in rebuilt.inputs] == [gi.name for gi in want.inputs]
    assert rebuilt.out_spec == want.out_spec
    for a, b in zip(want.gm.graph.nodes, rebuilt.gm.graph.nodes):
        assert a.meta.get("nn_module_stack") == b.meta.get("nn_module_stack"), a.format_node()


def test_a_rank_whose_inputs_differ_from_rank_0s_is_named():
    from autopar.core.errors import FingerprintMismatchError
    from autopar.runtime.shipping import Inputs, check_inputs

    def inputs(n: int, scale: float, device: str) -> Inputs:
        return Inputs.of((torch.zeros(2, n),), {"scale": scale, "mask": None, "device": torch.device(device)})

    rank0 = inputs(4, float("nan"), "cuda:0")
    check_inputs(rank0, inputs(4, float("nan"), "cuda:3"), rank=3)  # each rank on its own device: the same
    for mine, named in ((inputs(5, float("nan"), "cuda:3"), "args[0]"), (inputs(4, 2.0, "cuda:3"), "2.0")):
        with pytest.raises(FingerprintMismatchError) as err:
            check_inputs(rank0, mine, rank=3)
        assert "rank 3" in str(err.value) and named in str(err.value), str(err.value)


# ---- two ranks as plain processes, each with its own PYTHONHASHSEED ---------------------

RANK_SCRIPT = """
import json, sys, warnings
from datetime import timedelta
import torch, torch.distributed as dist
import autopar
from tests.test_trace_shipping import PerProcessOrder, _as_a_set
rank, store, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=120))
model = PerProcessOrder(_as_a_set).eval()
x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pm = autopar.compile(model, (x,), mesh=(2,))
with torch.no_grad():
    ok = torch.allclose(pm(x), model(x))
json.dump({"order": list(_as_a_set()), "ok": ok, "fingerprint": pm.plan.fingerprint}, open(out, "w"))
dist.barrier()
dist.destroy_process_group()
"""


def _set_order(seed: int) -> list[str]:
    code = f"print(list(set({NAMES!r})))"
    env = {**os.environ, "PYTHONHASHSEED": str(seed)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_ranks_with_different_hash_seeds_agree():
    seeds = (1, 2)
    assert _set_order(seeds[0]) != _set_order(seeds[1]), "pick seeds that order the set differently"
    with tempfile.TemporaryDirectory() as tmp:
        ended = run_processes([[sys.executable, "-c", RANK_SCRIPT, str(rank), f"{tmp}/store", f"{tmp}/rank{rank}.json"]
                               for rank in range(2)], [plain_env(PYTHONHASHSEED=str(seed)) for seed in seeds], 300)
        for rank, (code, log) in enumerate(ended):
            assert code == 0, f"rank {rank} failed:\n{log[-4000:]}"
        res = [json.loads(pathlib.Path(f"{tmp}/rank{r}.json").read_text()) for r in range(2)]
    assert res[0]["order"] != res[1]["order"]
    assert res[0]["fingerprint"] == res[1]["fingerprint"]
    assert res[0]["ok"] and res[1]["ok"]
