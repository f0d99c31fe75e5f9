"""Resuming on another world (autopar/runtime/world_change.py) with a data position that
survives it (autopar/runtime/data.py's ElasticSampler).

The runs on gloo ranks train a tiny Llama (no dropout) with AdamW for one epoch of 24
samples in global batches of 4 (6 steps):
- A: 4 ranks on (2, 2), uninterrupted;
- 4 -> 2: 4 ranks on (2, 2) for 3 steps and a checkpoint, then 2 ranks with the mesh the
  planner chooses (mesh="auto") from that checkpoint to the end;
- 2 -> 4: 2 ranks on (2,) for 3 steps, then 4 ranks on mesh=lambda world: (2, world // 2).
Each interrupted run's six losses equal A's within LOSS_RTOL, its final weights equal A's
within WEIGHT_ATOL, and its global batches are A's: every sample of the epoch exactly once.

Why a tolerance, not equality: the resumed steps run another plan's per-rank programs,
so each reduction (the loss over rows, each gradient over the ranks that split it) adds
the same fp32 terms in another order. One such sum differs by a few fp32 ulps (~1e-7
relative); AdamW divides each update by sqrt(v) + eps, which keeps those differences at
the same relative size instead of growing them, and 3 resumed steps at lr 1e-3 move a
weight by at most 3e-3. So the losses agree to well under 1e-5 relative and the weights
to well under 1e-5 absolute; the bounds below are those, with a factor of ten kept from
the first values measured (the losses equal in every bit, the weights within 2.1e-7), so
that a lost optimiser moment (a 1e-3 effect) or a skipped batch (a 1e-2 one) fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.core.errors import CheckpointError, MeshError
from autopar.runtime.checkpoint_files import MANIFEST, CheckpointManifest, verify_files
from autopar.runtime.data import ElasticSampler
from autopar.runtime.world_change import WorldChangedWarning, data_mismatch
from autopar.tools.simulated import CHEAP_COMM
from tests import models
from tests.harness import ROOT, plain_env, run_ranks

SAMPLES, BATCH, SEQ, STEPS, SPLIT = 24, 4, 8, 6, 3
LOSS_RTOL, WEIGHT_ATOL = 1e-5, 1e-5


def _dataset() -> torch.Tensor:
    return torch.randint(1, 64, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(5))


def _mesh_fn(world: int) -> tuple[int, ...]:
    return (2, world // 2)


MESHES = {"auto": "auto", "2x(w/2)": _mesh_fn}


# ---- a case run on gloo ranks ----------------------------------------------------------------
def train(rank: int, world: int, root: str, mesh, stop: int, save_at: int | None = None) -> dict:
    """Compile for `mesh` (a shape, "auto" or a key of MESHES), resume from `root` if it
    holds a checkpoint, train up to step `stop` over the sampler's global batches, and
    save at `save_at`. Returns the losses and batches of the steps this run took."""
    data = _dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(models.build("llama", seed=0).train(), (), {"input_ids": data[:BATCH],
                             "labels": data[:BATCH]}, mesh=MESHES.get(mesh, mesh), device=CHEAP_COMM)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=1e-6)
    sampler = ElasticSampler(SAMPLES, BATCH, seed=3)
    torch.manual_seed(1000 + rank)  # a stream of each rank's own (no op draws: the model has no dropout)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = autopar.resume(pm, opt, root, data=sampler)
    out = {"mesh": tuple(pm.mesh.shape), "start": manifest.step if manifest else 0, "losses": [], "batches": [],
           "rng_after_resume": torch.get_rng_state().clone(), "layouts": {n: str(s) for n, s in pm.state_specs.items()},
           "world_warnings": [str(w.message) for w in caught if issubclass(w.category, WorldChangedWarning)]}
    for step, indices in zip(range(out["start"], stop), sampler):
        ids = data[indices]
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["batches"].append(indices)
        if step + 1 == save_at:
            autopar.save_training_checkpoint(pm, opt, root, step + 1, data=sampler)
            out["rng_at_save"] = torch.get_rng_state().clone()
    out["weights"] = pm.full_state_dict()
    return out


def refusals(rank: int, world: int, root: str) -> dict:
    """On 2 ranks, against the 4 -> 2 run's checkpoint: another model, another data order,
    and a mesh function that returns a wrong shape are refused, and nothing changes."""
    data = _dataset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = autopar.compile(models.build("llama", seed=1, hidden_size=48).train(), (),
                             {"input_ids": data[:BATCH], "labels": data[:BATCH]}, mesh=(2,), device=CHEAP_COMM)
        same = autopar.compile(models.build("llama", seed=1).train(), (),
                               {"input_ids": data[:BATCH], "labels": data[:BATCH]}, mesh=(2,), device=CHEAP_COMM)
    out = {}
    before = {k: v.clone() for k, v in same.state_tensors.items()}
    rng = torch.get_rng_state().clone()
    for kind, model, sampler in (("model", pm, None), ("order", same, ElasticSampler(SAMPLES, BATCH, seed=4)),
                                 ("batch", same, ElasticSampler(SAMPLES, 2 * BATCH, seed=3))):
        try:
            autopar.resume(model, None, root, data=sampler)
            out[kind] = None
        except CheckpointError as e:
            out[kind] = str(e)
        out[f"{kind}_position"] = sampler.state_dict() if sampler is not None else None
    out["untouched"] = (all(torch.equal(v, same.state_tensors[k]) for k, v in before.items())
                        and torch.equal(rng, torch.get_rng_state()))
    try:
        autopar.compile(models.build("llama").train(), mesh=lambda w: (w, 2))
        out["bad_mesh"] = None
    except MeshError as e:
        out["bad_mesh"] = str(e)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    roots = {k: str(tmp_path_factory.mktemp(k)) for k in ("a", "shrink", "grow")}
    first_two = run_ranks(2, [(train, dict(root=roots["grow"], mesh=(2,), stop=SPLIT, save_at=SPLIT))])
    four = run_ranks(4, [(train, dict(root=roots["a"], mesh=(2, 2), stop=STEPS)),
                         (train, dict(root=roots["shrink"], mesh=(2, 2), stop=SPLIT, save_at=SPLIT)),
                         (train, dict(root=roots["grow"], mesh="2x(w/2)", stop=STEPS))])
    last_two = run_ranks(2, [(train, dict(root=roots["shrink"], mesh="auto", stop=STEPS)),
                             (refusals, dict(root=roots["shrink"]))])
    return {"a": [r[0] for r in four], "shrink": ([r[1] for r in four], [r[0] for r in last_two]),
            "grow": ([r[0] for r in first_two], [r[2] for r in four]), "refusals": [r[1] for r in last_two]}


@pytest.mark.slow  # three spawns of 2 and 4 ranks, 7 compiles (~60 s)
@pytest.mark.parametrize("change", ["shrink", "grow"])
def test_a_run_resumed_on_another_world_trains_like_the_uninterrupted_one(runs, change):
    a = runs["a"][0]
    before, after = runs[change]
    assert a["start"] == 0 and len(a["losses"]) == STEPS
    assert sorted(i for b in a["batches"] for i in b) == list(range(SAMPLES))  # one epoch, each sample once
    assert before[0]["mesh"] != after[0]["mesh"] and before[0]["layouts"] != after[0]["layouts"], \
        "both worlds ran the same layouts: nothing was resharded"
    for rank, res in enumerate(after):
        assert res["start"] == SPLIT, res["start"]
        assert res["mesh"] == ((2,) if change == "shrink" else (2, 2)), res["mesh"]
        losses = before[rank % len(before)]["losses"] + res["losses"]
        assert losses == pytest.approx(a["losses"], rel=LOSS_RTOL), (losses, a["losses"])
        assert before[rank % len(before)]["batches"] + res["batches"] == a["batches"]
        for name, want in a["weights"].items():
            torch.testing.assert_close(res["weights"][name], want, rtol=0, atol=WEIGHT_ATOL, msg=name)
        # rank r continues the torch stream saved by rank r % (old world)
        assert torch.equal(res["rng_after_resume"], before[rank % len(before)]["rng_at_save"])
        assert len(res["world_warnings"]) == (1 if rank == 0 else 0), res["world_warnings"]
    mesh = "(2,)" if change == "shrink" else "(2, 2)"
    assert f"on mesh {mesh}" in after[0]["world_warnings"][0], after[0]["world_warnings"][0]


@pytest.mark.slow
def test_another_model_or_data_order_is_refused_on_another_world_before_anything_changes(runs):
    for res in runs["refusals"]:
        assert "saved from another model" in res["model"], res["model"]
        assert "seed=3" in res["order"] and "make the sampler as the saving run did" in res["order"], res["order"]
        assert "global_batch_size=4" in res["batch"] and "rescale=True" in res["batch"], res["batch"]
        assert res["order_position"]["position"] == 0 and res["batch_position"]["position"] == 0
        assert res["untouched"]
        assert "returned (2, 2) for a world of 2 ranks" in res["bad_mesh"], res["bad_mesh"]


# ---- the sampler alone -----------------------------------------------------------------------
def test_every_sample_once_per_epoch_in_an_order_of_the_seed_alone():
    s = ElasticSampler(10, 3, seed=1)
    batches = list(s)
    assert len(batches) == 3 and all(len(b) == 3 for b in batches)  # drop_last: 1 sample left over
    assert len(set(i for b in batches for i in b)) == 9
    assert batches == list(ElasticSampler(10, 3, seed=1))
    assert batches != list(ElasticSampler(10, 3, seed=2))
    second = list(s)  # the epoch was done: iterating again is the next epoch, another order
    assert s.epoch == 1 and second != batches and len(second) == 3
    kept = ElasticSampler(10, 3, seed=1, drop_last=False)
    assert sorted(i for b in kept for i in b) == list(range(10))
    assert list(ElasticSampler(4, 2, shuffle=False)) == [[0, 1], [2, 3]]


def test_a_saved_position_continues_with_the_same_batches():
    whole = list(ElasticSampler(20, 4, seed=7))
    first = ElasticSampler(20, 4, seed=7)
    head = [first.next_batch(), first.next_batch()]
    state = first.state_dict()
    assert state["position"] == 8 and state["epoch"] == 0
    later = ElasticSampler(20, 4, seed=7)
    later.load_state_dict(state)
    assert head + list(later) == whole


def test_rescale_continues_the_epoch_at_the_same_sample():
    first = ElasticSampler(24, 4, seed=0)
    seen = [first.next_batch() for _ in range(3)]
    with pytest.raises(ValueError, match="rescale=True"):
        ElasticSampler(24, 6, seed=0).load_state_dict(first.state_dict())
    bigger = ElasticSampler(24, 6, seed=0, rescale=True)
    bigger.load_state_dict(first.state_dict())
    rest = list(bigger)
    assert [len(b) for b in rest] == [6, 6]
    assert sorted(i for b in seen + rest for i in b) == list(range(24))


def test_an_epoch_saved_at_its_end_resumes_at_the_next_one():
    done = ElasticSampler(8, 4, seed=2)
    epoch0 = list(done)
    assert done.state_dict()["epoch"] == 1 and done.state_dict()["position"] == 0
    resumed = ElasticSampler(8, 4, seed=2)
    resumed.load_state_dict(done.state_dict())
    epochs = []
    for e in range(resumed.epoch, 3):  # the DistributedSampler loop
        resumed.set_epoch(e)
        epochs.append(list(resumed))
    assert len(epochs) == 2  # epochs 1 and 2: the spent epoch 0 is not run again
    whole = ElasticSampler(8, 4, seed=2)
    assert [list(whole) for _ in range(3)] == [epoch0, *epochs]


def test_set_epoch_keeps_a_restored_position_in_its_own_epoch():
    first = ElasticSampler(12, 4, seed=0)
    head = first.next_batch()
    later = ElasticSampler(12, 4, seed=0)
    later.load_state_dict(first.state_dict())
    later.set_epoch(0)  # the loop's call for the epoch it is in: no restart
    assert head not in list(later) and later.position == 12
    later.set_epoch(3)
    assert later.epoch == 3 and later.position == 0


def test_a_data_position_without_mismatch_is_tried_on_a_copy():
    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            if state["n"] < 0:
                raise ValueError("negative")
            self.n = state["n"]

    def manifest(n):
        return CheckpointManifest(step=1, world_size=2, mesh=(2,), model_digest="", layout_digest="", plan_digest="",
                                  files=(), data={"n": n})
    c = Counter()
    assert data_mismatch(c, manifest(3), "ck") is None and c.n == 0  # checked on a copy: c unchanged
    assert "refused the data position (ValueError: negative)" in data_mismatch(c, manifest(-1), "ck")
    assert "holds no data position" in data_mismatch(c, replace(manifest(3), data=None), "ck")


@pytest.mark.parametrize("state, words", [
    ({"position": 1}, "not an ElasticSampler's state"),
    ({**ElasticSampler(9, 3).state_dict(), "position": 99}, "out of range"),
    ({**ElasticSampler(9, 3).state_dict(), "num_samples": 10}, "num_samples=10"),
])
def test_a_foreign_position_is_refused_and_changes_nothing(state, words):
    s = ElasticSampler(9, 3)
    s.next_batch()
    with pytest.raises(ValueError, match=words):
        s.load_state_dict(state)
    assert s.position == 3


@pytest.mark.parametrize("kw, words", [(dict(num_samples=0, global_batch_size=1), "num_samples=0"),
                                       (dict(num_samples=4, global_batch_size=5), "larger than the 4 samples"),
                                       (dict(num_samples=4, global_batch_size=2.0), "global_batch_size=2.0")])
def test_bad_sampler_arguments_are_refused(kw, words):
    with pytest.raises(ValueError, match=words):
        ElasticSampler(**kw)


# ---- under torchrun's elastic agent: a node lost, the job shrinks, then grows back ---------------
EXAMPLE = os.path.join(ROOT, "examples", "train_elastic.py")
ELASTIC_ARGS = ["--mesh", "auto", "--steps", "16", "--every", "2", "--step-sleep", "0.3", "--dropout", "0.0",
                "--timeout", "30"]


def _agent(run_dir: str, nproc: int, log, *launch: str) -> subprocess.Popen:
    # a fresh store per attempt: agents that joined at different times count restarts apart
    # (examples/_launch.py init_torchrun_group)
    store = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--monitor-interval",
           "0.2", *launch, EXAMPLE, "--run-dir", run_dir, *ELASTIC_ARGS]
    return subprocess.Popen(cmd, cwd=ROOT, env=plain_env(OMP_NUM_THREADS="1", **store), stdout=log,
                            stderr=subprocess.STDOUT)


def _lines(run_dir: str, name: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, name)) as f:
            return [json.loads(line) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _wait_for(seen, timeout_s: float, what: str, procs) -> None:
    deadline = time.monotonic() + timeout_s
    while not seen():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"never saw {what}")
        time.sleep(0.2)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and every process under it (its workers run in their own groups)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except OSError:
                continue
    todo, tree = [proc.pid], []
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _failure_excerpt(log: str) -> str:
    """A failed launch's log as an assertion message: each rank's fatal-signal dump (the
    example's ranks enable faulthandler) in full, then the log's tail."""
    dumps = [log[m.start(): m.start() + 6000] for m in re.finditer("Fatal Python error", log)]
    return "\n".join(dumps + ["--- tail ---", log[-4000:]])


def _one_device_weights() -> dict:
    """The example's 16 steps on the plain model in this process: the reference."""
    spec = importlib.util.spec_from_file_location("train_elastic", EXAMPLE)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)  # the example puts its own folder on sys.path for _launch
    args = ex.parser().parse_args(["--run-dir", "unused", *ELASTIC_ARGS])
    data, model = ex.dataset(args), ex.build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-6)
    for indices in ElasticSampler(len(data), args.batch, seed=args.data_seed):
        ids = data[indices]
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.slow  # three launches, 8 rank starts (~90 s)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to kill a node's process tree")
def test_a_lost_node_shrinks_the_job_and_a_later_launch_grows_it_back(tmp_path):
    """Two agents (--nnodes 1:2, 2 ranks each, as two nodes) train on 4 ranks; node 1's
    agent and workers are killed mid-run; the survivor's agent restarts its 2 ranks,
    which re-plan (mesh="auto") and resume from the newest checkpoint; then that node is
    lost too and a new 4-rank launch resumes and finishes. torchrun's agent would also
    take a returning node into the running job (a membership change), but on torch 2.13
    with both agents on one host that restart stalls in the rendezvous (the joining
    agent waits for MASTER_ADDR, the other for its role info, until both time out), so
    here the job grows back by a new launch."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    elastic = ["--nnodes", "1:2", "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--rdzv-conf",
               "last_call_timeout=3,join_timeout=120,close_timeout=5"]
    logs = [open(tmp_path / f"agent{i}.log", "w") for i in range(3)]
    try:
        node0 = _agent(run_dir, 2, logs[0], *elastic)
        time.sleep(1.0)  # node 0's agent hosts the rendezvous store: it must outlive node 1
        node1 = _agent(run_dir, 2, logs[1], *elastic)
        _wait_for(lambda: any(s["world"] == 4 and s["step"] >= 4 for s in _lines(run_dir, "steps.jsonl")), 300,
                  "4-rank steps", [node0, node1])
        _kill_tree(node1)
        _wait_for(lambda: sum(s["world"] == 2 for s in _lines(run_dir, "steps.jsonl")) >= 5, 300,
                  "the survivors' steps", [node0])
        _kill_tree(node0)
        regrown = _agent(run_dir, 4, logs[2], "--standalone")
        assert regrown.wait(timeout=300) == 0, _failure_excerpt((tmp_path / "agent2.log").read_text())
    finally:
        for log in logs:
            log.close()
    starts = [a for a in _lines(run_dir, "attempts.jsonl") if a["event"] == "start"]
    assert [(a["world"], a["resumed"]) for a in starts] == [(4, False), (2, True), (4, True)], starts
    timeline: dict[int, dict] = {}
    for s in _lines(run_dir, "steps.jsonl"):  # a step re-run after a loss: the later run counts
        timeline[s["step"]] = s
    assert sorted(timeline) == list(range(16))
    assert sorted(i for s in timeline.values() for i in s["batch"]) == list(range(64))  # each sample once
    assert {s["world"] for s in timeline.values()} == {2, 4}
    final = torch.load(os.path.join(run_dir, "final.pt"))
    for name, want in _one_device_weights().items():
        torch.testing.assert_close(final[name], want, rtol=0, atol=WEIGHT_ATOL, msg=name)
    root = os.path.join(run_dir, "checkpoints")
    for name in os.listdir(root):  # every step-N is whole: a manifest whose files all check out
        if ".tmp-" not in name:
            manifest = CheckpointManifest.from_dict(json.load(open(os.path.join(root, name, MANIFEST))), name)
            assert verify_files(os.path.join(root, name), manifest.files) is None, name
