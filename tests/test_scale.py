"""Planning at scale, offline: layer clustering, weightless planning of an 8B shape,
and evaluate() pricing any plan exactly as the solver does."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

import autopar
from autopar.cost_models.evaluate import evaluate
from autopar.passes.plan.hand_plans import DENSE_STYLES, hand_plan
from autopar.tools.zoo import build


def _plan(model, args, kwargs, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, args, kwargs, **kw)


def test_clustering_keeps_the_objective_with_far_fewer_variables():
    # 4-layer GPT-2 on (2, 4). Stated tolerance: objectives equal to 1e-9 relative with
    # either mode (sharing is exact unless a layer's best choice differs from its twins',
    # which it does not here). "all": the four blocks share one set of variables (under
    # 40% of the flat ILP's); "inner": the two inner blocks share one, the ends keep theirs.
    model, args, kwargs = build("gpt2-tiny", training=True, n_layer=4)  # training: the larger problem
    flat = _plan(model, args, kwargs, mesh=(2, 4), cluster_layers="off")
    inner = _plan(model, args, kwargs, mesh=(2, 4), cluster_layers="inner")
    shared = _plan(model, args, kwargs, mesh=(2, 4), cluster_layers="all")
    assert (flat.solver.shared_blocks, inner.solver.shared_blocks, shared.solver.shared_blocks) == (0, 1, 3)
    for clustered in (inner, shared):
        assert clustered.solver.objective_s == pytest.approx(flat.solver.objective_s, rel=1e-9)
        # boundaries are priced edge by edge: the plan's recomputed cost equals the objective
        assert clustered.total_s == pytest.approx(clustered.solver.objective_s, rel=1e-9)
    assert shared.solver.variables < 0.4 * flat.solver.variables, (shared.solver.variables, flat.solver.variables)
    assert inner.solver.variables < flat.solver.variables - 0.8 * (flat.solver.variables - shared.solver.variables) / 3
    # twins chose alike
    by_layer = {}
    for n in shared.nodes:
        if n.module.startswith("transformer.h."):
            layer, _, rest = n.module.removeprefix("transformer.h.").partition(".")
            by_layer.setdefault(layer, []).append((n.op, rest, str(n.outputs[0]) if n.outputs else ""))
    assert len(by_layer) == 4 and all(v == by_layer["0"] for v in by_layer.values())


def test_mixed_precision_blocks_share_as_full_precision_ones_do():
    # under param_dtype the blocks read bf16 copies their parameters' casts make at the top
    # of the graph; each cast belongs to its parameter's block, so twins are still found.
    # Same stated tolerance as above: the clustered objective equals the flat one to 1e-9
    import torch
    model, args, kwargs = build("gpt2-tiny", training=True, n_layer=4)
    mixed = dict(mesh=(2, 4), param_dtype=torch.bfloat16)
    flat = _plan(model, args, kwargs, cluster_layers="off", **mixed)
    inner, shared = (_plan(model, args, kwargs, cluster_layers=mode, **mixed) for mode in ("inner", "all"))
    assert (inner.solver.shared_blocks, shared.solver.shared_blocks) == (1, 3)
    assert any(n.op == "aten.to.dtype" and n.module == "" for n in shared.nodes)  # the casts are there, top level
    for clustered in (inner, shared):
        assert clustered.solver.objective_s == pytest.approx(flat.solver.objective_s, rel=1e-9)
    assert shared.solver.variables < 0.4 * flat.solver.variables, (shared.solver.variables, flat.solver.variables)


def test_cluster_mode_is_checked():
    model, args, kwargs = build("gpt2-tiny")
    with pytest.raises(ValueError, match="cluster_layers"):
        _plan(model, args, kwargs, mesh=(2, 2), cluster_layers="some")


def test_different_blocks_do_not_share():
    # an MLP whose layers differ in width has numbered blocks that are not twins
    from tests.models import MLP
    import torch
    model = MLP((16, 64, 32, 64, 16)).eval()
    plan = _plan(model, (torch.randn(8, 16),), None, mesh=(2, 2))
    assert plan.solver.shared_blocks == 0


@pytest.mark.slow
def test_llama3_8b_shape_plans_without_weights():
    # 32 layers, hidden 4096, 32 heads / 8 KV heads, vocab 128256 on (2, 4), in a fresh
    # process so its peak memory is its own: fp32 weights alone would be 32 GB
    script = (
        "import json, resource, time, warnings; warnings.simplefilter('ignore')\n"
        "import autopar\n"
        "from autopar.tools.zoo import build\n"
        "m, a, k = build('llama3-8b', device='meta', batch=8, seq=128, training=True)\n"
        "t = time.perf_counter(); p = autopar.plan(m, a, k, mesh=(2, 4), device='h100')\n"
        "print(json.dumps({'s': time.perf_counter() - t, 'rss_kib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,"
        " 'shared': p.solver.shared_blocks, 'params': sum(1 for n in p.nodes if n.kind == 'parameter'),"
        " 'sharded': sum(1 for n in p.nodes if n.kind == 'parameter' and not n.outputs[0].is_replicated()),"
        " 'status': p.solver.status}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["status"] == "Optimal" and res["shared"] == 29  # 30 inner layers share one set
    assert res["params"] == 32 * 9 + 3 and res["sharded"] > 0
    assert res["rss_kib"] < 3 * 2**20, f"peak RSS {res['rss_kib'] / 2**20:.1f} GiB: weights were allocated?"


@pytest.mark.slow
def test_evaluate_prices_every_plan_as_the_solver_does():
    mesh = (2, 4)
    model, args, kwargs = build("gpt2-tiny", training=True, batch=8)
    auto = _plan(model, args, kwargs, mesh=mesh)
    mine = evaluate(auto)
    assert mine.total_s == pytest.approx(auto.total_s, rel=1e-12)
    assert mine.memory_bytes == auto.memory_bytes
    for style in DENSE_STYLES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hand = hand_plan(model, args, kwargs, mesh=mesh, style=style)
        assert evaluate(hand).total_s == pytest.approx(hand.total_s, rel=1e-12)
        assert mine.total_s <= evaluate(hand).total_s * (1 + 1e-9), style
    # the same layouts on other hardware cost otherwise
    assert evaluate(auto, device="h100").total_s != mine.total_s
