"""Resumable training checkpoints (autopar/runtime/resume.py): continuing from a checkpoint
equals never stopping, bit for bit; incomplete or damaged checkpoints are refused with a
CheckpointError; a failed save leaves no final directory; and, under torchrun with a rank
killed mid-step, the elastic restart resumes and ends with the uninterrupted run's weights.

Equality is exact (torch.equal), not within a tolerance: the resumed run executes the same
per-rank programs on the same values in the same order (gloo's reductions are
deterministic on CPU), so any difference is a bug in what the checkpoint restores.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.core.errors import CheckpointError
from autopar.runtime.resume import (MANIFEST, PlanChangedWarning, checkpoint_dir, latest_checkpoint,
                                    load_training_checkpoint, resume, save_training_checkpoint)
from autopar.tools.simulated import CHEAP_COMM
from tests import models
from tests.harness import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_elastic.py")
MESH = (1, 2)


# ---- cases run on 2 gloo ranks -------------------------------------------------------------
def _compiled(seed: int, family: str = "gpt2"):
    """GPT-2 (tied embedding and head: one shard under two names) or, where only the
    files matter, a quicker MLP; both planned sharded on (1, 2)."""
    args, kwargs = models.inputs(family, batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(models.build(family, seed=seed).train(), args, kwargs, mesh=MESH, device=CHEAP_COMM)
    return pm, torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)


def _mlp_step(pm, opt) -> None:
    (x,), _ = models.inputs("mlp", batch=4)
    pm(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _train(pm, opt, steps: range) -> None:
    """AdamW steps whose batch order (torch RNG) and loss scale (python random) are drawn:
    a resume that lost either RNG, or the optimiser moments, ends elsewhere."""
    for step in steps:
        _, kwargs = models.inputs("gpt2", batch=4, seed=10 + step)
        ids = kwargs["input_ids"][torch.randperm(4)]
        loss = pm(input_ids=ids, labels=ids).loss * (1.0 + random.random())
        loss.backward()
        opt.step()
        opt.zero_grad()


def _params(pm) -> dict:
    return {k: v.detach().clone() for k, v in pm.state_tensors.items()}


def continue_equals_uninterrupted(rank: int, world: int, root: str) -> dict:
    """Run A: 3 steps, save, 3 more. Run B: another model's weights, a fresh optimiser,
    resume from A's checkpoint, the same 3 steps. Both end with the same shards and RNGs."""
    random.seed(0)
    pm, opt = _compiled(seed=0)
    _train(pm, opt, range(3))
    path = save_training_checkpoint(pm, opt, root, step=3, extra={"epoch": 0})
    _train(pm, opt, range(3, 6))
    a = {"params": _params(pm), "draws": (torch.rand(4), random.random())}
    random.seed(123)  # run B starts from other RNG states and other weights
    pm_b, opt_b = _compiled(seed=7)
    different_start = any(not torch.equal(pm_b.state_tensors[k], v) for k, v in _params(pm).items())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = resume(pm_b, opt_b, root)
    _train(pm_b, opt_b, range(manifest.step, 6))
    b = {"params": _params(pm_b), "draws": (torch.rand(4), random.random())}
    replan_warned = any(issubclass(w.category, PlanChangedWarning) for w in caught)
    return {"a": a, "b": b, "step": manifest.step, "extra": manifest.extra, "path": path,
            "different_start": different_start, "replan_warned": replan_warned,
            "adam_steps": [float(s["step"]) for s in opt_b.state.values()]}


def _damaged_copies(good: str, root: str) -> dict:
    """Rank 0 copies `good` and damages each copy one way; every rank gets the paths."""
    paths = {k: os.path.join(root, name) for k, name in [
        ("temp", "step-00000002.tmp-deadbeef"), ("no_marker", "step-00000003"), ("truncated", "step-00000004"),
        ("flipped", "step-00000005"), ("other_model", "step-00000006"), ("missing", "step-00000007"),
        ("pipelined_other_world", "step-00000000"), ("intact", "step-00000001")]}
    if dist.get_rank() == 0:
        for path in paths.values():
            shutil.copytree(good, path)
        os.remove(os.path.join(paths["temp"], MANIFEST))
        os.remove(os.path.join(paths["no_marker"], MANIFEST))
        shard = sorted(f for f in os.listdir(good) if f.endswith(".distcp"))[0]
        with open(os.path.join(paths["truncated"], shard), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(good, shard)) // 2)
        with open(os.path.join(paths["flipped"], shard), "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        os.remove(os.path.join(paths["missing"], ".metadata"))
        for kind, change in (("other_model", {"model_digest": "0" * 16}),
                             ("pipelined_other_world", {"world_size": 4, "mesh": [2, 2], "pipeline": {"axis": 0}})):
            marker = os.path.join(paths[kind], MANIFEST)
            with open(marker) as f:
                data = json.load(f)
            with open(marker, "w") as f:
                json.dump({**data, **change}, f)
    dist.barrier()
    return paths


def refusals(rank: int, world: int, root: str) -> dict:
    """Every damaged copy of a good checkpoint is refused on every rank, and the shards
    are untouched by a refused load."""
    pm, opt = _compiled(seed=0, family="mlp")
    _mlp_step(pm, opt)
    good = save_training_checkpoint(pm, opt, os.path.join(root, "good"), step=1)
    good_params = _params(pm)
    paths = _damaged_copies(good, os.path.join(root, "damaged"))
    _mlp_step(pm, opt)  # the shards now differ from every copy: a load that wrote them would show
    before = _params(pm)
    errors = {}
    for kind, path in paths.items():
        if kind == "intact":
            continue
        errors[kind] = _refusal(pm, opt, path)
    # an optimiser over other parameter groups: refused before dcp.load writes anything
    errors["groups"] = _refusal(pm, torch.optim.AdamW(list(pm.parameters())[:1]), good)
    # ranks given different (each intact) checkpoints
    errors["paths"] = _refusal(pm, opt, good if rank == 0 else paths["intact"])
    untouched = all(torch.equal(v, pm.state_tensors[k]) for k, v in before.items())
    # fallback: the newest four complete-looking copies are refused, newest first; the intact step 1 loads
    damaged = os.path.join(root, "damaged")
    errors["no_fallback"] = _refusal(pm, opt, None, lambda: resume(pm, opt, damaged))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fell_back_to = resume(pm, opt, damaged, fallback=True).step
    return {"errors": errors, "paths": paths, "untouched": untouched, "latest_damaged": latest_checkpoint(damaged),
            "fell_back_to": fell_back_to, "fallback_warnings": sum("fallback=True" in str(w.message) for w in caught),
            "restored": all(torch.equal(v, pm.state_tensors[k]) for k, v in good_params.items())}


def _refusal(pm, opt, path, load=None):
    try:
        load() if load else load_training_checkpoint(pm, opt, path)
        return None
    except CheckpointError as e:
        return (type(e).__name__, str(e), e.path)


def _save_failure(pm, opt, root, step, owner, name, replacement):
    """The CheckpointError text of a save with owner.name replaced on this rank (None:
    left alone), or None when the save succeeds."""
    original = getattr(owner, name)
    if replacement is not None:
        setattr(owner, name, replacement)
    try:
        save_training_checkpoint(pm, opt, root, step=step, keep=2)
        return None
    except CheckpointError as e:
        return str(e)
    finally:
        setattr(owner, name, original)


def failed_save_and_keep(rank: int, world: int, root: str) -> dict:
    """A save that fails on rank 1 raises on both ranks and leaves no step directory;
    keep=2 leaves the two newest complete checkpoints and no temp directory."""
    pm, opt = _compiled(seed=0, family="mlp")
    _mlp_step(pm, opt)
    for step in (1, 2, 3):
        save_training_checkpoint(pm, opt, root, step=step, keep=2)
    def broken(self, plan, planner):
        raise OSError("disk full (injected)")

    failure = _save_failure(pm, opt, root, 4, torch.distributed.checkpoint.FileSystemWriter, "write_data",
                            broken if rank == 1 else None)
    from autopar.runtime import resume as module
    # a step only rank 0 does fails: every rank raises, and the temp directory goes
    rank0_failure = _save_failure(pm, opt, root, 5, module, "list_files",
                                  (lambda folder: 1 / 0) if rank == 0 else None)
    dist.barrier()
    listing = sorted(os.listdir(root))
    # rank 0 chooses what every rank resumes: rank 1's own view of the directory is ignored
    own_view = module.latest_checkpoint
    if rank == 1:
        module.latest_checkpoint = lambda root: os.path.join(root, "step-00000002")
    try:
        resumed_at = resume(pm, opt, root).step
    finally:
        module.latest_checkpoint = own_view
    nothing = resume(pm, opt, os.path.join(root, "empty"))
    # another plan (the cpu preset keeps this tiny MLP whole): DCP reshards exactly, and it warns
    (x,), _ = models.inputs("mlp", batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = autopar.compile(models.build("mlp", seed=5).train(), (x,), mesh=MESH, device="cpu")
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3, eps=1e-6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume(other, other_opt, root)
    want, got = pm.full_state_dict(), other.full_state_dict()
    return {"failure": failure, "rank0_failure": rank0_failure, "rollback": _rollback(pm, opt, root), "listing": listing, "latest": latest_checkpoint(root), "resumed_at": resumed_at,
            "fresh_start": nothing is None, "plans_differ": other.plan.digest() != pm.plan.digest(),
            "replan_warned": any(issubclass(w.category, PlanChangedWarning) for w in caught),
            "replanned_equal": all(torch.equal(got[k], v) for k, v in want.items())}


def _rollback(pm, opt, root: str) -> dict:
    """Steps 3 and 4 saved, then step 2 (a rollback): 3 and 4 are set aside, not counted
    toward keep, and the next resume continues from step 2."""
    root = os.path.join(root, "rollback")
    for step in (3, 4):
        save_training_checkpoint(pm, opt, root, step=step, keep=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_training_checkpoint(pm, opt, root, step=2, keep=1)
    dist.barrier()
    return {"listing": sorted(os.listdir(root)), "resumed_at": resume(pm, opt, root).step,
            "warned": any("renamed aside" in str(w.message) for w in caught)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    roots = [str(tmp_path_factory.mktemp(n)) for n in ("resume", "refuse", "fail")]
    return run_ranks(2, [(continue_equals_uninterrupted, dict(root=roots[0])), (refusals, dict(root=roots[1])),
                         (failed_save_and_keep, dict(root=roots[2]))])


def test_resume_restores_optimizer_rng_and_position(two_ranks):
    for rank, per_rank in enumerate(two_ranks):
        res = per_rank[0]
        assert res["different_start"], "run B must start from other weights, or the test could not fail"
        assert res["step"] == 3 and res["extra"] == {"epoch": 0} and not res["replan_warned"]
        assert res["adam_steps"] and set(res["adam_steps"]) == {6.0}  # 3 restored + 3 more
        for name, want in res["a"]["params"].items():
            assert torch.equal(res["b"]["params"][name], want), f"rank {rank} {name} differs after resuming"
        assert torch.equal(res["a"]["draws"][0], res["b"]["draws"][0]) and res["a"]["draws"][1] == res["b"]["draws"][1]


@pytest.mark.parametrize("kind, words", [
    ("temp", "incomplete"), ("no_marker", "incomplete"), ("truncated", "bytes, the manifest says"),
    ("flipped", "crc32"), ("other_model", "saved from another model"),
    ("pipelined_other_world", "keyed by pipeline stage"), ("missing", "missing its file")])
def test_damaged_checkpoint_is_refused(two_ranks, kind, words):
    for per_rank in two_ranks:
        res = per_rank[1]
        found = res["errors"][kind]
        assert found is not None, f"{kind} checkpoint was loaded"
        name, message, path = found
        assert name == "CheckpointError" and words in message and res["paths"][kind] in message, message
        assert path == res["paths"][kind]
        assert res["untouched"]


@pytest.mark.parametrize("kind, words", [("groups", "other parameter groups"), ("paths", "different checkpoints")])
def test_mismatched_load_is_refused_on_every_rank_before_any_write(two_ranks, kind, words):
    for per_rank in two_ranks:
        res = per_rank[1]
        assert res["errors"][kind] is not None and words in res["errors"][kind][1], res["errors"][kind]
        assert res["untouched"]


def test_resume_with_fallback_loads_the_newest_checkpoint_that_is_whole(two_ranks):
    for per_rank in two_ranks:
        res = per_rank[1]
        assert res["errors"]["no_fallback"] is not None and "missing its file" in res["errors"]["no_fallback"][1]
        assert res["fell_back_to"] == 1 and res["fallback_warnings"] == 4 and res["restored"]


def test_latest_skips_incomplete_directories(two_ranks):
    """latest_checkpoint judges by the marker alone: of the damaged copies it skips the
    temp directory and the one without a manifest; the newest with one is step 7."""
    res = two_ranks[0][1]
    assert res["latest_damaged"] == res["paths"]["missing"]


def test_failed_save_leaves_no_checkpoint_and_rank0_decides_the_resume(two_ranks):
    for per_rank in two_ranks:
        res = per_rank[2]
        assert res["failure"] is not None and "rank 1: OSError: disk full (injected)" in res["failure"], res["failure"]
        assert res["rank0_failure"] is not None and "failed on rank 0 (ZeroDivisionError" in res["rank0_failure"]
        assert res["listing"] == ["step-00000002", "step-00000003"], res["listing"]
        assert res["latest"].endswith("step-00000003")
        assert res["resumed_at"] == 3 and res["fresh_start"]


def test_saving_an_earlier_step_sets_later_checkpoints_aside(two_ranks):
    for per_rank in two_ranks:
        res = per_rank[2]["rollback"]
        assert res["resumed_at"] == 2 and res["warned"]
        assert res["listing"][0] == "step-00000002" and len(res["listing"]) == 3, res["listing"]
        assert [n[:len("step-00000003.stale-")] for n in res["listing"][1:]] == [
            "step-00000003.stale-", "step-00000004.stale-"], res["listing"]


def test_resume_under_another_plan_reshards_exactly_and_warns(two_ranks):
    for per_rank in two_ranks:
        res = per_rank[2]
        assert res["plans_differ"], "the cpu preset planned the MLP as the cheap-comm one did: the test is void"
        assert res["replan_warned"] and res["replanned_equal"]


def test_latest_checkpoint_without_ranks(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    for name in ("step-00000005", "step-00000009.tmp-0a1b2c3d", "step-00000012", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-00000005" / MANIFEST).write_text("{}")
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step-00000005")
    assert checkpoint_dir(tmp_path, 12) == str(tmp_path / "step-00000012")


# ---- a lost rank under torchrun ------------------------------------------------------------
def _torchrun(run_dir: str, *extra: str) -> tuple[list[dict], str]:
    """examples/train_elastic.py on 2 ranks under torchrun's elastic agent (one restart
    allowed): 8 steps, a checkpoint every 3. Returns rank 0's attempt log, and the tail of
    what the job printed (why a rank died, where a restart was not expected)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.1", EXAMPLE, "--run-dir", run_dir, "--mesh", "1,2",
           "--steps", "8", "--every", "3", "--keep", "2", *extra]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    with open(os.path.join(run_dir, "attempts.jsonl")) as f:
        return [json.loads(line) for line in f], f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.mark.slow  # two torchrun jobs, three attempts of 2 ranks (~40 s)
def test_killed_rank_resumes_and_ends_where_an_uninterrupted_run_does(tmp_path):
    killed, plain = str(tmp_path / "killed"), str(tmp_path / "plain")
    log, output = _torchrun(killed, "--kill-rank", "1", "--kill-step", "4")
    assert os.path.exists(os.path.join(killed, "killed.marker")), "rank 1 never killed itself"
    # the agent restarted the group once, and attempt 2 resumed at the step-3 checkpoint, not from scratch
    assert log == [{"event": "start", "step": 0, "resumed": False, "world": 2, "restart": 0},
                   {"event": "start", "step": 3, "resumed": True, "world": 2, "restart": 1},
                   {"event": "end", "steps_run": 5, "world": 2, "restart": 1}], f"{log}\n{output}"
    log, output = _torchrun(plain)
    assert log == [{"event": "start", "step": 0, "resumed": False, "world": 2, "restart": 0},
                   {"event": "end", "steps_run": 8, "world": 2, "restart": 0}], f"{log}\n{output}"
    got = torch.load(os.path.join(killed, "final.pt"))
    want = torch.load(os.path.join(plain, "final.pt"))
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} differs from the uninterrupted run"
    assert sorted(os.listdir(os.path.join(killed, "checkpoints"))) == ["step-00000003", "step-00000006"]


def test_a_crash_while_pruning_leaves_no_complete_looking_checkpoint(tmp_path, monkeypatch):
    from autopar.runtime import resume as module
    for step in (1, 2):
        (tmp_path / f"step-0000000{step}").mkdir()
        (tmp_path / f"step-0000000{step}" / MANIFEST).write_text("{}")
    monkeypatch.setattr(module.shutil, "rmtree", lambda *a, **k: None)  # the crash: nothing deleted yet
    module._prune(str(tmp_path), 1, str(tmp_path / "step-00000002"))
    assert module.complete_checkpoints(tmp_path) == [(2, str(tmp_path / "step-00000002"))]


@pytest.mark.parametrize("kw, words", [(dict(step=-1), "step=-1"), (dict(step=3, keep=0), "keep=0"),
                                       (dict(step=3, keep=1.5), "keep=1.5"), (dict(step=True), "step=True"),
                                       (dict(step=3, extra={"sampler": object()}), "JSON"),
                                       (dict(step=3, extra=[1, 2]), "dict with str keys"),
                                       (dict(step=3, extra="ab"), "dict with str keys"),
                                       (dict(step=3, extra={1: "x"}), "dict with str keys")])
def test_bad_save_arguments_are_refused_before_any_collective(tmp_path, kw, words):
    with pytest.raises(CheckpointError, match=words):
        save_training_checkpoint(None, None, tmp_path, **kw)  # no process group: refused before one is needed
    assert os.listdir(tmp_path) == []


def test_checkpoint_error_crosses_processes_with_its_path():
    e = pickle.loads(pickle.dumps(CheckpointError("checkpoint /x is incomplete", "/x")))
    assert isinstance(e, CheckpointError) and e.path == "/x" and str(e) == "checkpoint /x is incomplete"
