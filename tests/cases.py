"""Cases that run inside every gloo rank (see harness.run_ranks)."""

from __future__ import annotations

import warnings

import torch

import autopar
from autopar.core.kinds import NodeKind
from autopar.passes.plan.hand_plans import hand_plan
# nearly free communication, dear compute: the solver shards as much as its rules allow,
# which exercises every reshard path
from autopar.tools.simulated import CHEAP_COMM
from tests import models


def _leaves(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        return [t for t in out.to_tuple() if isinstance(t, torch.Tensor)]
    return [t for t in out if isinstance(t, torch.Tensor)]


def forward_equivalence(rank: int, world: int, model: str, mesh: tuple, device: str = "cheap", batch: int = 2,
                        seq: int = 8, **over) -> dict:
    """Parallel outputs on this rank next to the single-device outputs."""
    m = models.build(model, **over)
    args, kwargs = models.inputs(model, batch, seq)
    with torch.no_grad():
        reference = _leaves(m(*args, **kwargs))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, args, kwargs, mesh=mesh, device=CHEAP_COMM if device == "cheap" else device)
    with torch.no_grad():
        parallel = _leaves(pm(*args, **kwargs))
    plan = pm.plan
    return {"reference": reference, "parallel": parallel, "placements": plan.placements(),
            "collectives": [str(c) for c in plan.collectives()], "sharded_params":
            sum(1 for n in plan.nodes if n.kind is NodeKind.PARAMETER and not n.outputs[0].is_replicated())}


def _loss(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return (out.float() ** 2).mean()
    return out.loss if getattr(out, "loss", None) is not None else (out[0] ** 2).mean()


def gradient_equivalence(rank: int, world: int, model: str, mesh: tuple, device: str = "cheap", batch: int = 2,
                         seq: int = 8, style: str = "", budget: float = 0.0, loss_only: bool = False,
                         ignored: int = 0, **over) -> dict:
    """Loss and every local parameter gradient on this rank, next to the matching block
    of the single-device gradient. `style`: run that hand plan (autopar/hand_plans.py)
    instead of autopar's; `budget`: plan under this fraction of the unbounded plan's
    memory per rank (recompute, sharded parameters); `loss_only`: the model returns its
    loss alone (zoo.LossOnly); `ignored`: the labels of the last positions are -100."""
    import copy

    from autopar.tools.zoo import LossOnly
    m = models.build(model, **over).train()
    m = LossOnly(m) if loss_only else m
    ref_model = copy.deepcopy(m)
    args, kwargs = models.inputs(model, batch, seq)
    if ignored:
        kwargs["labels"] = kwargs["labels"].clone()
        kwargs["labels"][:, -ignored:] = -100
    ref_loss = _loss(ref_model(*args, **kwargs))
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in ref_model.named_parameters(remove_duplicate=False)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dev = CHEAP_COMM if device == "cheap" else device
        # the hand plan made once (rank 0: trace + pinned solve) and sent to every rank, as
        # the solver's own plan is; compile's start-up check still has every rank agree
        plan = _planned_on_rank0(lambda: hand_plan(m, args, kwargs, mesh=mesh, style=style, device=dev)) \
            if style else None
        bound = {}
        if budget:
            # the unbounded plan's memory, planned once on rank 0 (every rank planning it
            # costs the spawn each rank's solve on 2 shared cores)
            free = _planned_on_rank0(
                lambda: autopar.plan(m, args, kwargs, mesh=mesh, device=dev, memory_budget_bytes=None).memory_bytes)
            bound = {"memory_budget_bytes": int(free * budget)}
        pm = autopar.compile(m, args, kwargs, mesh=mesh, device=dev, plan=plan, **bound)
    loss = _loss(pm(*args, **kwargs))
    loss.backward()
    plan = pm.plan
    return {"loss": loss.detach(), "ref_loss": ref_loss.detach(), "grads": _grad_pairs(pm, ref_grads, rank),
            "collectives": [str(c) for c in plan.collectives()], "placements": plan.placements(),
            "shared_blocks": plan.solver.shared_blocks,
            "attention": [str(n.outputs[0]) for n in plan.nodes if n.op == "aten.scaled_dot_product_attention.default"],
            "balanced": _balanced_attention(pm),
            "loss_rows": [str(n.inputs[0]) for n in plan.nodes if n.op == "aten.cross_entropy_loss.default"],
            "experts": [str(n.inputs[-1]) for n in plan.nodes if n.op == "autopar.routed_experts.default"],
            "routed_rows": [str(n.inputs[0]) for n in plan.nodes if n.op == "autopar.routed_experts.default"],
            "recomputed": [n for b in plan.recompute for n in b.nodes],
            "mesh": plan.mesh.shape, "mesh_candidates": [c.shape for c in plan.mesh_candidates]}


def split_outputs_equivalence(rank: int, world: int, model: str, mesh: tuple, style: str, batch: int = 4,
                              seq: int = 8) -> dict:
    """Options(sharded_outputs=True) under a hand plan whose logits are made split: the
    logits come back as a DTensor holding this rank's block, the loss whole; an objective
    that reads both (the loss plus a term of the gathered logits) trains every parameter
    as on one device, so gradients flow back through the DTensor too; autopar.verify
    passes the plan (it gathers split outputs to compare them)."""
    import copy

    from torch.distributed.tensor import DTensor

    from autopar.core.placement import local_chunk
    m = models.build(model).train()
    ref_model = copy.deepcopy(m)
    args, kwargs = models.inputs(model, batch, seq)
    ref = ref_model(*args, **kwargs)
    (ref.loss + 1e-2 * (ref.logits ** 2).mean()).backward()
    ref_grads = {k: p.grad for k, p in ref_model.named_parameters(remove_duplicate=False)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = _planned_on_rank0(lambda: hand_plan(m, args, kwargs, mesh=mesh, style=style, device=CHEAP_COMM,
                                                   sharded_outputs=True))
        pm = autopar.compile(m, args, kwargs, mesh=mesh, device=CHEAP_COMM, plan=plan)
    out = pm(*args, **kwargs)
    logits = out.logits
    spec = pm.plan.node("output").inputs[1]
    (out.loss + 1e-2 * (logits.full_tensor() ** 2).mean()).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = autopar.verify(models.build(model).train(), args, kwargs, mesh=mesh, plan=plan, device=CHEAP_COMM)
    return {"loss": out.loss.detach(), "ref_loss": ref.loss.detach(), "grads": _grad_pairs(pm, ref_grads, rank),
            "verified": report.ok, "report": str(report),
            "is_dtensor": isinstance(logits, DTensor), "loss_is_plain": type(out.loss) is torch.Tensor,
            "spec": str(spec), "local": logits.to_local().detach(),
            "expected": local_chunk(ref.logits.detach(), spec, pm.plan.mesh.shape, pm.plan.mesh.coords(rank)),
            "whole": logits.full_tensor().detach(), "ref_logits": ref.logits.detach()}


def _balanced_attention(pm) -> int:
    """How many attentions this rank's program runs balanced with a mirror rank."""
    from autopar.passes.lower.program import CausalRowsModule
    program = pm.current.program.gm if pm.current is not None else None
    return sum(isinstance(m, CausalRowsModule) for m in program.modules()) if program is not None else 0


def _planned_on_rank0(make):
    """What make() returns on rank 0, broadcast to every rank."""
    import torch.distributed as dist
    box = [make() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _grad_pairs(pm, ref_grads: dict, rank: int) -> dict:
    """Parameter -> (this rank's gradient, the matching block of the reference gradient, spec)."""
    from autopar.core.placement import local_chunk
    plan = pm.plan
    used = {e.producer for e in plan.edges}
    pairs = {}
    for gi in pm.current.traced.inputs:
        if gi.kind != "parameter" or gi.name not in used:  # a tied twin the graph never reads
            continue
        spec = plan.node(gi.name).outputs[0]
        local = pm.shards.get_parameter(gi.target)
        expect = None if ref_grads[gi.target] is None else \
            local_chunk(ref_grads[gi.target], spec, plan.mesh.shape, plan.mesh.coords(rank))
        pairs[gi.target] = (local.grad, expect, str(spec))
    return pairs


def zoo_equivalence(rank: int, world: int, name: str, mesh: tuple, training: bool = True) -> dict:
    """A zoo model (autopar/zoo.py, or the tests' CNN) on this rank: every output leaf
    (logits, loss) and, in training, every local parameter gradient, next to the
    single-device model's."""
    import copy
    from autopar.tools.zoo import build
    if name.startswith("resnet-"):
        torch.manual_seed(0)
        m = models.TinyResNet(name.removeprefix("resnet-")).train(training)
        args, kwargs = (torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)),), {}
    else:
        m, args, kwargs = build(name, batch=8, seq=8, training=training)
    ref_model = copy.deepcopy(m)
    ref_out = ref_model(*args, **kwargs)
    reference = [t.detach() for t in _leaves(ref_out)]
    if training:
        _loss(ref_out).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, args, kwargs, mesh=mesh, device=CHEAP_COMM)
    out = pm(*args, **kwargs)
    parallel = [t.detach() for t in _leaves(out)]
    grads = {}
    if training:
        _loss(out).backward()
        grads = _grad_pairs(pm, {k: p.grad for k, p in ref_model.named_parameters(remove_duplicate=False)}, rank)
    plan = pm.plan
    return {"reference": reference, "parallel": parallel, "grads": grads,
            "sharded_params": sum(1 for n in plan.nodes if n.kind is NodeKind.PARAMETER
                                  and not n.outputs[0].is_replicated()),
            "discovered": plan.discovered_ops, "replicated": plan.unruled_ops}


def lazy_signatures(rank: int, world: int, mesh: tuple) -> dict:
    """compile without inputs: planned at the first call, re-planned per new shape,
    parameter layouts kept from the first plan."""
    m = models.build("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, mesh=mesh, device=CHEAP_COMM)
        out = {}
        for batch, seq in [(2, 8), (4, 4), (2, 8)]:
            args, kwargs = models.inputs("gpt2", batch, seq)
            with torch.no_grad():
                out[(batch, seq)] = (pm(*args, **kwargs).logits, m(*args, **kwargs).logits)
    return {"outputs": out, "plans": len(pm.programs)}


def compile_from_plan_file(rank: int, world: int, plan_path: str, mesh: tuple, model: str = "gpt2") -> dict:
    """A saved plan drives the program (no solve): outputs equal the single-device ones."""
    m = models.build(model)
    args, kwargs = models.inputs(model, batch=4)
    with torch.no_grad():
        reference = _leaves(m(*args, **kwargs))
    pm = autopar.compile(m, args, kwargs, mesh=mesh, plan=plan_path)
    with torch.no_grad():
        parallel = _leaves(pm(*args, **kwargs))
    return {"reference": reference, "parallel": parallel, "digest": pm.plan.digest()}


def plan_file_for_other_model(rank: int, world: int, plan_path: str, mesh: tuple) -> dict:
    m = models.build("gpt2", n_layer=1)  # the plan file was made for the 2-layer model
    args, kwargs = models.inputs("gpt2", batch=4)
    try:
        autopar.compile(m, args, kwargs, mesh=mesh, plan=plan_path)
    except autopar.AutoparError as e:
        return {"error_type": type(e).__name__, "message": str(e)}
    return {"error_type": None}


def mismatched_plans(rank: int, world: int, plan_paths: list, mesh: tuple) -> dict:
    """Rank 0 is handed a different (valid) plan than the others: every rank must fail
    fast at the start-up check instead of hanging in a collective."""
    import time
    m = models.build("gpt2")
    args, kwargs = models.inputs("gpt2", batch=4)
    t0 = time.monotonic()
    try:
        autopar.compile(m, args, kwargs, mesh=mesh, plan=plan_paths[0 if rank == 0 else 1])
    except autopar.AutoparError as e:
        return {"error_type": type(e).__name__, "message": str(e), "seconds": time.monotonic() - t0}
    return {"error_type": None, "seconds": time.monotonic() - t0}


def fuzz_on_ranks(rank: int, world: int, specs: list) -> dict:
    """Fuzzed models on real gloo ranks: forward outputs and local gradients."""
    import copy
    from autopar.core.placement import local_chunk
    from tests import fuzz_models
    out = []
    for spec in specs:
        model, x = fuzz_models.build(spec)
        ref = copy.deepcopy(model)
        ref_out = ref(x)
        (ref_out ** 2).mean().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(model, (x,), mesh=spec["mesh"], device=fuzz_models.device_for(spec))
        y = pm(x)
        (y ** 2).mean().backward()
        grads = {}
        for n in pm.plan.nodes:
            if n.kind is NodeKind.PARAMETER:
                gi = next(g for g in pm.current.traced.inputs if g.name == n.name)
                grads[gi.target] = (pm.shards.get_parameter(gi.target).grad,
                                    local_chunk(dict(ref.named_parameters())[gi.target].grad, n.outputs[0],
                                                pm.plan.mesh.shape, pm.coords))
        out.append({"out": y.detach(), "ref": ref_out.detach(), "grads": grads})
    return {"cases": out}


def one_rank_fails(rank: int, world: int, where: str, timeout_s: float = 8.0, done_dir: str = "") -> dict:
    """Rank 1 fails on purpose ('compile': different input shapes; 'step': raises before
    its forward). The others must raise within the collective timeout, not hang.
    `done_dir`: each other rank leaves a file there once it has raised, and rank 1 (alive
    but silent until then, so no peer sees its connections close) stops once all have,
    instead of always sleeping out 3 timeouts; a peer that hangs still keeps rank 1 there
    for the 3 timeouts, and then raises later than the test allows."""
    import os
    import time
    m = models.build("mlp")
    x = torch.randn(8 if (where == "compile" and rank == 1) else 4, 16)
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(m, (x,), mesh=(2, 2), device=CHEAP_COMM, collective_timeout_s=timeout_s)
        if where == "step":
            if rank == 1:  # alive but silent: its peers must give up after the timeout
                wake = time.monotonic() + timeout_s * 3
                while time.monotonic() < wake and not (done_dir and len(os.listdir(done_dir)) == world - 1):
                    time.sleep(0.1)
                raise KeyboardInterrupt("rank 1 stops on purpose") from None
            pm(x)
            pm(x)
    except KeyboardInterrupt as e:
        return {"error": None, "raised_on_purpose": str(e), "seconds": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - what the test inspects
        seconds = time.monotonic() - t0
        if done_dir and where == "step":
            open(os.path.join(done_dir, f"rank{rank}"), "w").close()
        return {"error": None, "caught": f"{type(e).__name__}: {e}", "seconds": seconds}
    return {"error": None, "caught": None, "seconds": time.monotonic() - t0}


def verify_plans(rank: int, world: int, mesh: tuple) -> dict:
    """autopar.verify on the solver's plan, then on a plan with one reduction removed."""
    import dataclasses
    m = models.build("mlp")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.plan(m, (x,), mesh=mesh, device=CHEAP_COMM)
    good = autopar.verify(m, (x,), mesh=mesh, plan=plan, layers=True)
    victim = next(e for e in plan.edges if any(s.kind == "all_reduce" for s in e.steps))
    broken_edge = dataclasses.replace(victim, steps=tuple(s for s in victim.steps if s.kind != "all_reduce"))
    corrupted = dataclasses.replace(plan, edges=tuple(broken_edge if e is victim else e for e in plan.edges))
    bad = autopar.verify(m, (x,), mesh=mesh, plan=corrupted, layers=True)
    return {"good": good, "bad": bad, "victim": (victim.producer, victim.consumer)}


def train_steps(rank: int, world: int, model: str, mesh: tuple, steps: int = 5, device: str = "cheap") -> dict:
    """AdamW steps on the mesh and on one device from the same start: per-step losses and
    the gathered parameters after the last step."""
    import copy
    m = models.build(model).train()
    ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, mesh=mesh, device=CHEAP_COMM if device == "cheap" else device)
        # eps=1e-6: GPT-2's key bias has an exactly-zero true gradient (softmax ignores a
        # shift shared by all keys), so both runs see only rounding noise (~1e-10) there;
        # with the default eps=1e-8 AdamW would blow that noise up to +-lr steps that differ
        # between any two summation orders, parallel or not
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)  # the issue's own lr
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-6)
        losses, ref_losses = [], []
        for step in range(steps):
            args, kwargs = models.inputs(model, batch=4, seed=10 + step)
            loss = _loss(pm(*args, **kwargs))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = _loss(ref(*args, **kwargs))
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            losses.append(loss.detach())
            ref_losses.append(ref_loss.detach())
    full = pm.full_state_dict()
    ref_state = ref.state_dict()
    return {"losses": torch.stack(losses), "ref_losses": torch.stack(ref_losses),
            "params": {k: (full[k], ref_state[k]) for k in ref_state}}


def training_utilities(rank: int, world: int, tmp: str) -> dict:
    """clip_grad_norm_, full state dict round trip, DCP save on (2, 4) and load on (1, 8),
    local inputs and input_specs."""
    import copy
    m = models.build("gpt2").train()
    ref = copy.deepcopy(m)
    args, kwargs = models.inputs("gpt2", batch=4)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, args, kwargs, mesh=(2, 4), device=CHEAP_COMM)
        # 1. clipping equals torch's on the single model
        pm(*args, **kwargs).loss.backward()
        ref(*args, **kwargs).loss.backward()
        out["norm"] = pm.clip_grad_norm_(0.05)
        out["ref_norm"] = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        from autopar.core.placement import local_chunk
        ref_grads = dict(ref.named_parameters())
        out["clipped"] = [(pm.shards.get_parameter(k).grad, local_chunk(ref_grads[k].grad, s, (2, 4), pm.coords))
                          for k, s in pm.state_specs.items() if k in ref_grads and
                          pm.shards.get_parameter(k).grad is not None]
        # 2. full state dict loads into the original model class
        fresh = models.build("gpt2", seed=123)
        fresh.load_state_dict(pm.full_state_dict())
        with torch.no_grad():
            out["roundtrip"] = (fresh(*args, **kwargs).logits, m(*args, **kwargs).logits)
            pm.load_full_state_dict(models.build("gpt2", seed=5).state_dict())
            out["loaded"] = (pm(*args, **kwargs).logits, models.build("gpt2", seed=5)(*args, **kwargs).logits)
            pm.load_full_state_dict(m.state_dict())
            # 3. sharded checkpoint: save on (2, 4), load into the same model compiled for (1, 8)
            before = pm(*args, **kwargs).logits
            pm.save_checkpoint(tmp)
            other = autopar.compile(models.build("gpt2", seed=99), args, kwargs, mesh=(1, 8), device=CHEAP_COMM)
            other.load_checkpoint(tmp)
            out["dcp"] = (other(*args, **kwargs).logits, before)
            # 4. local inputs: each rank passes only its block
            local_args, local_kwargs = pm.shard_inputs(*args, **kwargs)
            out["local"] = (pm(*local_args, local_inputs=True, **local_kwargs).logits, before)
            out["input_specs"] = {k: str(v) for k, v in pm.input_specs.items()}
    return out


def meta_model_loads_its_shards(rank: int, world: int, path: str, widths: tuple) -> dict:
    """A model built on the meta device compiles; each rank reads only its blocks from a
    safetensors file. RssAnon (anonymous memory, not the file's page cache) is sampled
    every millisecond while loading."""
    import threading
    import time
    from tests.models import MLP

    def rss_anon() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    with torch.device("meta"):
        model = MLP(widths, bias=False).eval()
    x = torch.randn(1, widths[0], generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(model, (x,), mesh=(1, world))
    try:
        pm(x)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    base = rss_anon()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        pm.load_safetensors(path)
    finally:
        stop.set()
        sampler.join()
    shard_bytes = sum(p.numel() * p.element_size() for p in pm.parameters())
    with torch.no_grad():
        y = pm(x)
    return {"refused": refused, "peak_increase": peak[0] - base, "shard_bytes": shard_bytes, "out": y}


def calibrate_links(rank: int, world: int, mesh: tuple, path: str) -> dict:
    """cost_model="profile": links calibrated on this process group, op timings measured
    for the plan, the profile cached in `path` and reused by the next compile."""
    import os
    m = models.build("mlp")
    x = torch.randn(64, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, (x,), mesh=mesh, cost_model="profile", profile_path=path)
        first = os.path.getmtime(path) if rank == 0 else None
        with torch.no_grad():
            out = (pm(x), m(x))
    from autopar.passes.plan.planning import load_profile
    profile = load_profile(path) if rank == 0 else None
    return {"comm": profile and profile.comm, "note": pm.plan.cost_note,
            "sync_s": profile and profile.collective_sync_s, "out": out, "first_mtime": first,
            "program_factor": profile and profile.program_factor}


def bucketed_data_parallel(rank: int, world: int) -> dict:
    """A data-parallel plan: its parameters' gradient all-reduces leave the program and run
    bucketed after backward; two backwards accumulate before the comparison."""
    import copy
    from autopar.core.placement import local_chunk
    m = models.build("mlp", widths=(64, 256, 64, 256, 64)).train()
    ref = copy.deepcopy(m)
    xs = [torch.randn(8192, 64, generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, (xs[0],), mesh=(world, 1))
    buffers = []
    for x in xs:
        (pm(x) ** 2).mean().backward()
        (ref(x) ** 2).mean().backward()
        buffers.append([b.flat for b in pm.current.buckets.buckets])  # held: no address reused
    deferred = pm.current.program.deferred_grad_syncs
    grads = {k: (pm.shards.get_parameter(k).grad.clone(),
                 local_chunk(p.grad, pm.state_specs[k], pm.mesh.shape, pm.coords)) for k, p in ref.named_parameters()}
    try:  # autograd.grad does not accumulate into .grad, where the reduced gradients go
        torch.autograd.grad((pm(xs[0]) ** 2).mean(), list(pm.parameters()))
        refused = ""
    except autopar.GradientError as e:
        refused = str(e)
    after = (pm(xs[0]) ** 2).mean()  # every rank still in step: the next collective completes
    return {"deferred": deferred, "code": pm.code, "grads": grads, "refused": refused, "after": after.detach(),
            "same_buffers": [x is not None and x is y for x, y in zip(*buffers)]}


def deferred_data_parallel(rank: int, world: int) -> dict:
    """Options.grad_sync_every=2 on a data-parallel plan: each rank's gradients after every
    one of four backwards (with the reductions run so far) next to one device's
    accumulated gradients."""
    import copy
    m = models.build("mlp", widths=(64, 256, 64, 256, 64)).train()
    ref = copy.deepcopy(m)
    xs = [torch.randn(8192, 64, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, (xs[0],), mesh=(world, 1), options=autopar.Options(grad_sync_every=2))
    after = []
    for x in xs:
        (pm(x) ** 2).mean().backward()
        (ref(x) ** 2).mean().backward()
        after.append(({k: p.grad.clone() for k, p in pm.shards.named_parameters()},
                      {k: p.grad.clone() for k, p in ref.named_parameters()}, pm.current.buckets.reductions))
    return {"after": after, "replicated": all(s.is_replicated() for s in pm.state_specs.values()),
            "deferred": len(pm.current.program.deferred_grad_syncs)}


def forced_plan(model, args: tuple, mesh: tuple, op: str, keep, more: "dict | None" = None):
    """The best plan in which every `op` node runs a strategy `keep(strategy)` accepts (and
    every node of each op in `more` one its own test accepts): a way to run a strategy
    the costs would not pick on a tiny model."""
    from dataclasses import replace
    from autopar.cost_models.model import CostModel
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.solve.solve import solve
    from autopar.passes.strategies.strategies import annotate
    from autopar.passes.trace.trace import trace
    graph = annotate(trace(model, args), Mesh(mesh))
    tests = {op: keep, **(more or {})}
    nodes = tuple(replace(n, strategies=tuple(s for s in n.strategies if tests[n.op](s))) if n.op in tests else n
                  for n in graph.nodes)
    graph = replace(graph, nodes=nodes, by_name={n.name: n for n in nodes})
    return solve(graph, CostModel.analytic("cpu", mesh, model.training), Options())


def vocab_parallel_embedding(rank: int, world: int, mesh: tuple) -> dict:
    """An embedding split by vocabulary (each rank looks up its own rows, partial sums
    all-reduced), forced, against one device: output and gradients."""
    import copy
    torch.manual_seed(0)
    m = models.BigVocab(vocab=64, hidden=3).train()
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    ref_model = copy.deepcopy(m)
    ref_out = ref_model(ids)
    _loss(ref_out).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = forced_plan(m, (ids,), mesh, "aten.embedding.default",
                           lambda s: all(p == autopar.Shard(0) for p in s.inputs[0].placements))
        pm = autopar.compile(m, (ids,), mesh=mesh, plan=plan)
    out = pm(ids)
    _loss(out).backward()
    grads = _grad_pairs(pm, {k: p.grad for k, p in ref_model.named_parameters()}, rank)
    return {"reference": [ref_out.detach()], "parallel": [out.detach()], "grads": grads,
            "embedding": str(plan.node("embedding").outputs[0]), "weight": str(plan.node("p_embed_weight").outputs[0])}


def batch_norm_training(rank: int, world: int, mesh: tuple, steps: int = 2) -> dict:
    """TinyResNet with BatchNorm in training: SGD steps on the mesh and on one device from
    the same start. Per step: outputs, this rank's gradients next to the reference's
    blocks, and the full state (parameters, running statistics, num_batches_tracked)
    from pm.full_state_dict next to the reference's; after the last step, this rank's
    buffers in the sharded (checkpoint) state dict next to the reference's blocks."""
    import copy
    from autopar.core.placement import local_chunk
    torch.manual_seed(0)
    m = models.TinyResNet(norm="batch").train()
    ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(m, mesh=mesh, device=CHEAP_COMM)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    out: dict = {"outputs": [], "grads": [], "states": []}
    for step in range(steps):
        x = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(10 + step))
        y, ry = pm(x), ref(x)
        _loss(y).backward()
        _loss(ry).backward()
        out["outputs"].append((y.detach(), ry.detach()))
        out["grads"].append(_grad_pairs(pm, {k: p.grad for k, p in ref.named_parameters()}, rank))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        out["states"].append((pm.full_state_dict(), {k: v.clone() for k, v in ref.state_dict().items()}))
    sharded, ref_state = pm.sharded_state_dict(), ref.state_dict()
    out["sharded_buffers"] = {k: (sharded[k].to_local().clone(), local_chunk(ref_state[k], pm.state_specs[k], mesh,
                                                                             pm.coords))
                              for k, _ in ref.named_buffers()}
    out["synced_means"] = sum(1 for n in pm.plan.nodes if n.op == "aten.mean.dim" and str(n.inputs[0]).startswith("S(0)"))
    return out


def trace_forms(rank: int, world: int, mesh: tuple) -> dict:
    """The argument forms the sweep found broken, compiled by autopar on real ranks: a
    slice write, a no_grad region, a buffer counted under no_grad, squeeze() of a split
    dim, a hand-written exact autograd.Function. Per model: outputs and this rank's
    gradients beside one device's."""
    import copy
    from autopar.tools.simulated import loss_of
    from tests.test_rules import _SqueezeAll
    from tests.test_trace import CountsInNoGrad, CustomBackward, NoGradRegion, SliceWrite, _HandGelu
    forms = {"slice write": (SliceWrite, (4, 6, 16)), "no_grad region": (NoGradRegion, (4, 6, 16)),
             "counter under no_grad": (CountsInNoGrad, (4, 8)), "squeeze()": (_SqueezeAll, (4, 8)),
             "exact custom backward": (lambda: CustomBackward(_HandGelu), (4, 6, 16))}
    out = {}
    for name, (build, shape) in forms.items():
        torch.manual_seed(0)
        m, x = build().train(), torch.randn(*shape)
        ref = copy.deepcopy(m)
        want = ref(x)
        loss_of(want).backward()
        ref_grads = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = autopar.compile(m, (x,), mesh=mesh, device=CHEAP_COMM)
        got = pm(x)
        loss_of(got).backward()
        out[name] = {"output": (got.detach(), want.detach()), "grads": _grad_pairs(pm, ref_grads, rank)}
    return out


def inputs_differ_later(rank: int, world: int, call: int = 3, timeout_s: float = 120.0,
                        both_planned: bool = False) -> dict:
    """Every rank passes the same inputs until call `call`, where rank 1 passes a shorter
    batch (an uneven last batch): every rank must raise InputMismatchError at once, not
    wait out the collective timeout. Then the same call with the same inputs runs.
    `both_planned`: the first call passes the shorter batch on every rank, so at the
    mismatched call every rank holds a program for its inputs (each launches the
    agreement and settles it at its program's first collective)."""
    import time
    m = models.build("mlp")
    pm = autopar.compile(m, mesh=(world,), device=CHEAP_COMM, collective_timeout_s=timeout_s)
    full = torch.randn(4, 16)
    for i in range(call - 1):
        pm(full[:3] if both_planned and i == 0 else full).sum().backward()
    t0 = time.monotonic()
    try:
        pm(full[:3] if rank == 1 else full)
    except autopar.AutoparError as e:
        caught = (type(e).__name__, str(e))
    else:
        caught = None
    seconds = time.monotonic() - t0
    with torch.no_grad():
        after = (pm(full), m(full))
    return {"caught": caught, "seconds": seconds, "after": after, "plans": len(pm.programs)}


class ComplexRotary(torch.nn.Module):
    """torchtitan's rotary embedding: pairs of features as complex numbers times a complex
    table (freqs_cis, complex64), then back to real."""

    def __init__(self, seq: int = 8, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.o = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), torch.rand(width // 2))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        pairs = torch.view_as_complex(q.reshape(*q.shape[:-1], -1, 2))
        turned = torch.view_as_real(pairs * self.freqs_cis).flatten(-2)
        return self.o(turned)


def complex_resharded(rank: int, world: int) -> dict:
    """A plan that moves a complex tensor between ranks (the q projection split by columns,
    the complex product by sequence), on gloo: output and gradients against one device."""
    import copy
    m = ComplexRotary().train()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(m)
    _loss(ref(x)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = forced_plan(m, (x,), (world,), "aten.linear.default",
                           lambda s: s.outputs[0].placements != (autopar.Shard(1),),
                           {"aten.mul.Tensor": lambda s: s.inputs[0].placements == (autopar.Shard(1),)})
        pm = autopar.compile(m, (x,), mesh=(world,), plan=plan)
    out = pm(x)
    _loss(out).backward()
    complex_moves = [s.kind.name for e in plan.edges for s in e.steps
                     if s.kind.communicates and s.before is not None and s.before.meta.dtype.is_complex]
    return {"reference": ref(x).detach(), "parallel": out.detach(), "moves": complex_moves,
            "grads": _grad_pairs(pm, {k: p.grad for k, p in ref.named_parameters()}, rank)}


def complex_collectives(rank: int, world: int) -> dict:
    """Each collective of runtime/collectives.py on complex64 blocks over gloo, with the
    results one device computes from the whole tensor."""
    import torch.distributed as dist
    from autopar.core.kinds import StepKind
    from autopar.runtime.collectives import AxisComm, Move, move
    group = dist.group.WORLD
    comm = AxisComm(group, world, rank, group.group_name)
    g = torch.Generator().manual_seed(3)
    whole = torch.complex(torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g))
    mine = whole.chunk(world, dim=0)[rank]
    got = {
        "all_to_all": move(Move(StepKind.ALL_TO_ALL, 0, 1, size=4, to_size=6, complex=True), mine, comm),
        "all_gather": move(Move(StepKind.ALL_GATHER, 1, size=6, complex=True),
                           whole.chunk(world, dim=1)[rank].contiguous(), comm),
        "reduce_scatter": move(Move(StepKind.REDUCE_SCATTER, 1, size=6, complex=True), whole * (rank + 1), comm),
        "all_reduce": move(Move(StepKind.ALL_REDUCE, complex=True), whole * (rank + 1), comm),
    }
    total = whole * sum(range(1, world + 1))
    want = {"all_to_all": whole.chunk(world, dim=1)[rank], "all_gather": whole,
            "reduce_scatter": total.chunk(world, dim=1)[rank], "all_reduce": total}
    return {"got": got, "want": want}


def crash_natively(rank: int, world: int, log: str) -> dict:
    """Rank 0 dies of SIGSEGV inside C code (a read of address 0), as a heap corruption
    would kill it, its standard error sent to the file `log` first (a rank's fd 2 is the
    fork server's, not the test's); the others wait at a barrier and are ended by the harness."""
    import ctypes
    import os
    import torch.distributed as dist
    if rank == 0:
        os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT, 0o644), 2)
        ctypes.string_at(0)
    dist.barrier()
    return {}
