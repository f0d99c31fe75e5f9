"""The runtime's parts: one error type on every rank, the eager plan, process groups
made once per mesh, and rank programs that run only once bound to process groups."""

from __future__ import annotations

import warnings

import pytest
import torch

import autopar
from autopar.core.errors import FingerprintMismatchError, MemoryBudgetError, ProcessGroupError
from autopar.passes.lower.emit import emit
from autopar.passes.plan.planning import plan_traced
from autopar.passes.trace.trace import trace
from autopar.tools.simulated import CHEAP_COMM
from tests import cases, models
from tests.harness import run_ranks


# ---- cases run on every gloo rank (module level: the spawned ranks import them) ----------

def rank0_planning_error(rank: int, world: int) -> dict:
    """Only rank 0 solves; its MemoryBudgetError must reach every rank as itself."""
    m = models.build("mlp")
    x = torch.randn(8, 16)
    try:
        autopar.compile(m, (x,), mesh=(world,), memory_budget_bytes=1)
    except autopar.AutoparError as e:
        return {"type": type(e).__name__, "budget": getattr(e, "budget_bytes", None),
                "notes": list(getattr(e, "__notes__", []))}
    return {"type": None}


def eager_plan_and_group_reuse(rank: int, world: int) -> dict:
    m = models.build("mlp")
    x = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = autopar.compile(m, (x,), mesh=(world,))
        digest_before_any_call = first.plan.digest()  # planned now: no call needed
        code = first.code
        second = autopar.compile(models.build("mlp", seed=3), (x,), mesh=(world,))
        with torch.no_grad():
            out = first(x)
    return {"digest": digest_before_any_call, "has_code": "def forward" in code,
            "same_groups": all(a.group is b.group for a, b in zip(first.comms, second.comms)),
            "worker_threads": [c.group._get_backend(torch.device("cpu")).options._threads for c in first.comms],
            "out": out, "want": m(x).detach()}


def verify_gpt2(rank: int, world: int) -> dict:
    """verify on a transformers model whose config keeps its KV cache on: the reference
    runs as traced (no cache), so outputs pair up one to one."""
    m = models.build("gpt2")
    m.config.use_cache = True
    args, kwargs = models.inputs("gpt2")
    report = autopar.verify(m, args, kwargs, mesh=(world,))
    return {"ok": report.ok, "outputs": len(report.outputs), "text": str(report), "use_cache": m.config.use_cache}


def compile_release_compile(rank: int, world: int, rounds: int = 4) -> dict:
    """Model after model in one process: each ParallelModule and its model are freed
    once dropped (no hook or cache keeps them), and process groups are made once."""
    import gc
    import weakref
    from autopar.runtime import groups
    freed = []
    for _ in range(rounds):
        m = models.build("mlp")
        x = torch.randn(8, 16)
        pm = autopar.compile(m, (x,), mesh=(world,))
        (pm(x) ** 2).mean().backward()
        refs = (weakref.ref(pm), weakref.ref(m))
        del pm, m
        gc.collect()
        freed.append(all(r() is None for r in refs))
    return {"freed": freed, "group_sets": len(groups._CACHE)}


def train_then_eval(rank: int, world: int) -> dict:
    """pm.eval() after training calls: the model runs without dropout, as model.eval() does."""
    m = models.build("gpt2", resid_pdrop=0.5).train()
    _, kwargs = models.inputs("gpt2")
    pm = autopar.compile(m, mesh=(world,))
    was_training = pm.training
    pm(**kwargs).loss.backward()
    pm.eval()
    with torch.no_grad():
        got = pm(**kwargs).logits
        want = m(**kwargs).logits  # m itself is in eval mode now
    pm.train()
    pm(**kwargs)
    return {"was_training": was_training, "got": got, "want": want,
            "traces": pm.trace_count, "plans": len(pm.plans), "model_training_again": m.training}


def steps_free_without_the_cycle_collector(rank: int, world: int, steps: int = 3) -> dict:
    """A training step's autograd graph (activations, launched collectives) is freed
    when its last reference goes, not by Python's cycle collector: a cycle through the
    graph kept every step's activations alive until a collection, and forwards ran ever
    slower as memory grew."""
    import gc
    m = models.build("gpt2").train()
    _, kwargs = models.inputs("gpt2", batch=8, seq=16)
    pm = autopar.compile(m, mesh=(world,), device=CHEAP_COMM)  # free links: collectives in the plan
    pm(**kwargs).loss.backward()  # warm: plans, buckets and caches made once
    was_enabled = gc.isenabled()
    gc.disable()
    gc.collect()
    try:
        found = []
        for _ in range(steps):
            out = pm(**kwargs)
            del out  # a forward never differentiated
            pm(**kwargs).loss.backward()
            found.append(sum(isinstance(o, torch.Tensor) for o in _garbage()))
    finally:
        if was_enabled:
            gc.enable()
    return {"tensors_left_to_the_collector": found, "collectives": [c.kind.value for c in pm.plan.collectives()]}


def _garbage() -> list:
    """What only the cycle collector would free (collected here to look at it)."""
    import gc
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        return list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


# ---- tests ---------------------------------------------------------------------------

def test_an_error_while_rank0_plans_is_raised_as_itself_on_every_rank():
    results = run_ranks(2, [(rank0_planning_error, {})])
    for rank, (res,) in enumerate(results):
        assert res["type"] == "MemoryBudgetError", (rank, res)
        assert res["budget"] == 1
    assert any("raised on rank 0" in n for n in results[1][0]["notes"])


def test_eager_compile_has_its_plan_at_once_and_groups_are_made_once_per_mesh():
    results = run_ranks(2, [(eager_plan_and_group_reuse, {})])
    digests = {res["digest"] for (res,) in results}
    assert len(digests) == 1
    for (res,) in results:
        assert res["has_code"] and res["same_groups"]
        # gloo's default two worker threads per group corrupt the heap with collectives in
        # flight (autopar/runtime/serial_gloo.py); autopar's groups run one
        assert res["worker_threads"] == [1], res["worker_threads"]
        torch.testing.assert_close(res["out"], res["want"])


def groups_under_a_gpu_bound_default_group(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from autopar.runtime.groups import mesh_groups
    # what init_process_group("nccl", device_id=cuda:LOCAL_RANK) leaves: every later
    # new_group is asked for its backend of that device, the gloo ones too
    dist.group.WORLD.bound_device_id = torch.device("cuda", 0)
    groups = mesh_groups(autopar.Mesh((world,)), torch.device("cpu"), 60)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total, group=groups.span)
    dist.group.WORLD.bound_device_id = None  # the harness's barrier after this runs on the CPU
    return {"total": total.item()}


def test_autopars_gloo_groups_are_made_where_the_default_group_is_bound_to_a_gpu():
    for (res,) in run_ranks(2, [(groups_under_a_gpu_bound_default_group, {})]):
        assert res["total"] == 3.0


def test_compiled_modules_are_freed_and_process_groups_reused():
    results = run_ranks(2, [(compile_release_compile, {})])
    for (res,) in results:
        assert res["freed"] == [True] * 4
        assert res["group_sets"] == 1


def test_a_plan_for_another_graph_is_one_error_type():
    x = torch.randn(8, 16)
    plan = plan_traced(trace(models.build("mlp"), (x,)), autopar.Mesh((2,)), autopar.Options())[1]
    other = trace(models.build("mlp"), (torch.randn(4, 16),))  # other shapes: another graph
    with pytest.raises(FingerprintMismatchError) as err:
        emit(other, plan, (0,))
    assert err.value.expected == plan.fingerprint and err.value.found == other.fingerprint
    assert "re-plan" in str(err.value)


def test_an_unbound_program_says_it_cannot_run():
    x = torch.randn(8, 16)
    traced = trace(models.build("mlp"), (x,))
    plan = plan_traced(traced, autopar.Mesh((2,)), autopar.Options(device="h100"),
                       pinned={"layers.0.weight": (autopar.Shard(0),)})[1]
    program = emit(traced, plan, (0,))
    assert "ap_" in program.code  # it has reshard steps
    state = dict(models.build("mlp").named_parameters())
    with pytest.raises(ProcessGroupError, match="emitted for reading"):
        from autopar.passes.lower.emit import local_inputs
        program.gm(*local_inputs(program, {k: v.detach() for k, v in state.items()}, traced.constants, [x], (2,),
                                 state_is_local=False))


def test_memory_budget_error_pickles_with_its_fields():
    import pickle
    e = pickle.loads(pickle.dumps(MemoryBudgetError(10, 20)))
    assert (e.budget_bytes, e.smallest_bytes) == (10, 20) and "smallest footprint" in str(e)


def test_verify_a_transformers_model_with_its_kv_cache_on():
    results = run_ranks(2, [(verify_gpt2, {})])
    for (res,) in results:
        assert res["ok"], res["text"]
        assert res["outputs"] == 2  # loss and logits, no cache tensors
        assert res["use_cache"] is True  # the user's config is as it was


def mixed_precision_training(rank: int, world: int, model: str, mesh: tuple, steps: int = 4) -> dict:
    """bf16 compute on fp32 master shards (Options.param_dtype / reduce_dtype) against one
    device under torch.autocast(bfloat16), both trained with AdamW from the same weights."""
    from tests.cases import CHEAP_COMM
    m = models.build(model).train()
    ref = models.build(model).train()
    ref.load_state_dict(m.state_dict())
    args, kwargs = models.inputs(model, batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, args, kwargs, mesh=mesh, device=CHEAP_COMM, param_dtype=torch.bfloat16,
                             reduce_dtype=torch.float32)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    before = {k: t.detach().clone() for k, t in pm.state_tensors.items()}
    losses, ref_losses, out_dtypes = [], [], set()
    for _ in range(steps):
        out = pm(*args, **kwargs)
        out_dtypes.add(out.logits.dtype)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = ref(*args, **kwargs).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    masters = {str(t.dtype) for t in pm.parameters()}
    moved = sum(1 for k, t in pm.state_tensors.items() if t.is_floating_point() and t.numel()
                and not torch.equal(t.detach(), before[k]))
    casts = sum(1 for n in pm.plan.nodes if n.op in ("aten.to.dtype", "aten._to_copy.default"))
    return {"losses": losses, "ref": ref_losses, "masters": masters, "moved": moved, "casts": casts,
            "out_dtypes": {str(d) for d in out_dtypes}, "sharded": sum(1 for s in pm.state_specs.values()
                                                                      if not s.is_replicated())}


@pytest.mark.slow
def test_mixed_precision_tracks_autocast_and_updates_fp32_masters():
    results = run_ranks(4, [(mixed_precision_training, dict(model=model, mesh=(2, 2))) for model in ("gpt2", "llama")])
    for rank, res in ((r, res) for r, cases in enumerate(results) for res in cases):
        assert res["masters"] == {"torch.float32"} and res["out_dtypes"] == {"torch.float32"}
        assert res["moved"] > 0 and res["casts"] > 0 and res["sharded"] > 0
        # bf16 tolerance: the two runs round differently (autocast keeps some ops in fp32)
        for got, want in zip(res["losses"], res["ref"]):
            assert abs(got - want) <= 2e-2 * abs(want), (rank, res["losses"], res["ref"])
        assert res["losses"][-1] < res["losses"][0]  # it trains


def test_options_refuse_a_non_floating_param_dtype():
    with pytest.raises(autopar.OptionsError, match="param_dtype"):
        autopar.Options(param_dtype=torch.int8)
    with pytest.raises(autopar.OptionsError, match="reduce_dtype"):
        autopar.plan(models.build("mlp"), (torch.randn(4, 16),), mesh=(2,), reduce_dtype="float32")


def compiled_training(rank: int, world: int, model: str) -> dict:
    """Options.compile: the rank program under torch.compile(fullgraph=True), collectives
    in the graph; outputs and gradients against one device, two steps (the second reuses it)."""
    from tests.cases import CHEAP_COMM
    from autopar.core.placement import local_chunk
    m = models.build(model).train()
    ref = models.build(model).train()
    ref.load_state_dict(m.state_dict())
    args, kwargs = models.inputs(model, batch=4)
    pm = autopar.compile(m, args, kwargs, mesh=(world,), device=CHEAP_COMM, compile=True)
    got = pm(*args, **kwargs)
    got_loss = got.loss if hasattr(got, "loss") else (got ** 2).mean()
    got_loss.backward()
    want = ref(*args, **kwargs)
    want_loss = want.loss if hasattr(want, "loss") else (want ** 2).mean()
    want_loss.backward()
    ref_params = dict(ref.named_parameters())
    grads = {k: (pm.state_tensors[k].grad, local_chunk(ref_params[k].grad, s, pm.mesh.shape, pm.coords))
             for k, s in pm.state_specs.items() if k in ref_params and ref_params[k].grad is not None}
    again = pm(*args, **kwargs)
    return {"loss": (got_loss.detach(), want_loss.detach()), "grads": grads, "collectives": len(pm.plan.collectives()),
            "compiled": type(pm.current.run).__name__, "again": (again.loss if hasattr(again, "loss") else again).detach()}


@pytest.mark.slow
def test_compiled_rank_programs_match_one_device():
    results = run_ranks(2, [(compiled_training, dict(model="mlp")), (compiled_training, dict(model="gpt2"))])
    for rank, cases in enumerate(results):
        for res in cases:
            assert res["compiled"] == "_FirstCallFallback" and res["collectives"] > 0
            torch.testing.assert_close(*res["loss"])
            assert res["grads"]
            for name, (got, want) in res["grads"].items():
                torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} grad {name}: {m}")


def test_compile_without_a_cxx_compiler_runs_eagerly_with_one_warning(monkeypatch):
    from autopar.runtime import compiling
    monkeypatch.setattr(compiling.shutil, "which", lambda name: None)
    gm = torch.fx.symbolic_trace(models.build("mlp"))
    with pytest.warns(compiling.CompileFallbackWarning, match="no C.. compiler"):
        run = compiling.compiled_program(gm, torch.device("cpu"))
    assert run is gm


def test_cuda_graphs_are_refused_on_a_cpu_rank_and_with_dynamic_shapes():
    from autopar.core.errors import OptionsError
    from autopar.runtime import compiling
    options = autopar.Options(cuda_graphs=True)
    assert options.compile and options.compile_options == {"mode": "reduce-overhead"}
    gm = torch.fx.symbolic_trace(models.build("mlp"))
    with pytest.raises(OptionsError, match="need the rank's tensors on a CUDA device; this rank runs on cpu"):
        compiling.compiled_program(gm, torch.device("cpu"), options.compile_options)
    with pytest.raises(OptionsError, match="replay one recorded shape"):
        autopar.Options(cuda_graphs=True, dynamic=True)
    with pytest.raises(OptionsError, match="replay one recorded shape"):  # the same asked through compile_options
        autopar.Options(compile=True, compile_options={"mode": "reduce-overhead"}, dynamic=True)
    with pytest.raises(OptionsError, match="mode='max-autotune'"):
        autopar.Options(cuda_graphs=True, compile_options={"mode": "max-autotune"})


def test_eval_after_training_runs_the_models_eval_graph():
    # a module compiled in training mode and switched with pm.eval() must trace the eval
    # graph (no dropout), not keep running the training program; each mode keeps its own
    results = run_ranks(2, [(train_then_eval, {})])
    for (res,) in results:
        assert res["was_training"] and res["model_training_again"]
        torch.testing.assert_close(res["got"], res["want"])
        assert res["traces"] == 2 and res["plans"] == 2, res


def test_overlapped_steps_free_their_graph_without_the_cycle_collector():
    results = run_ranks(2, [(steps_free_without_the_cycle_collector, {})])
    for (res,) in results:
        assert res["collectives"]  # each runs as a start and a wait
        assert res["tensors_left_to_the_collector"] == [0, 0, 0]


def test_complex_values_travel_over_gloo_as_their_real_view():
    # gloo has no complex all-to-all: before, every rank failed with "Invalid scalar type"
    results = run_ranks(2, [(cases.complex_collectives, {}), (cases.complex_resharded, {})])
    for rank, (moves, _) in enumerate(results):
        for kind, got in moves["got"].items():
            assert got.dtype == torch.complex64, (kind, got.dtype)
            torch.testing.assert_close(got, moves["want"][kind], msg=lambda m: f"rank {rank} {kind}: {m}")
    for rank, (_, res) in enumerate(results):
        assert res["moves"], "the forced plan must move a complex tensor between ranks"
        torch.testing.assert_close(res["parallel"], res["reference"], rtol=1e-5, atol=1e-6)
        assert res["grads"], "no parameter gradients to compare"
        for name, (got, want, spec) in res["grads"].items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name} {spec}: {m}")
