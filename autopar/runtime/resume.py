"""Resumable training checkpoints: a directory is either complete or ignored, never read
half-written.

    root/
      step-00000020/               complete: its manifest was written before the rename
        manifest.json              step, world size, mesh, digests, bytes + crc32 per file
        .metadata  __0_0.distcp .. torch.distributed.checkpoint (DCP) files, one per rank
      step-00000030.tmp-3f9a1c2e/  a save in progress, or one a crash abandoned: ignored

Saving (every rank calls save_training_checkpoint at the same step):
1. Rank 0 draws a token and broadcasts it, so every rank writes into the same
   `step-N.tmp-<token>`, a directory no earlier (crashed) attempt used.
2. dcp.save writes model shards, optimiser states (autopar/runtime/train_state.py) and
   each rank's RNG states. DCP gathers every rank's write result, so a failure on any
   rank raises on all of them, and nothing below runs.
3. Each rank checksums its share of the files; rank 0 gathers sizes and crc32s.
4. Rank 0 writes manifest.json into the temp directory (written whole, fsynced): the
   completion marker. Then it renames the directory to `step-N` (atomic on POSIX) and
   fsyncs the parent, and broadcasts the outcome, so a failed rename raises everywhere.
5. Only now, with the new checkpoint complete, rank 0 deletes checkpoints older than
   the newest `keep` and temp directories of saves that never finished.

Loading: every rank reads the manifest (a directory without one is refused), checks
world size, mesh and model against it, and verifies bytes and crc32 of its share of the
files; the ranks exchange what they found, so all raise the same CheckpointError or none
does. Then dcp.load fills shards, optimiser and RNGs. `resume` lets rank 0 choose the
newest complete checkpoint and broadcasts its path, so all ranks load the same one even
if a save completes while they look.

What must match: world size and mesh (each rank restores its own RNG streams, and the
per-rank programs are the mesh's) and the model (names, shapes, dtypes). Another plan on
the same mesh only warns (PlanChangedWarning): DCP reshards weights and optimiser states
exactly, but the continuation runs other programs, so it is not bit-identical.

Why: torchrun's elastic agent restarts the whole group after a lost rank, at any moment
of a save. The restarted group must find a checkpoint that is whole and must continue as
if it was never stopped: same weights, optimiser moments, data position (the step) and
random draws. Every collective here runs on the default process group, under the
timeout it was initialised with, so a dead peer turns into an error, not a hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from autopar.core.errors import CheckpointError
from autopar.core.files import write_json_atomic
from autopar.runtime.state import ShardedModel
from autopar.runtime.train_state import load_targets, restore, training_entries

MANIFEST = "manifest.json"
FORMAT = 1
_COMPLETE = re.compile(r"^step-(\d+)$")
_TEMP = ".tmp-"
_CHUNK = 1 << 20


class PlanChangedWarning(UserWarning):
    """A checkpoint is resumed under another plan than the one it was saved under."""


@dataclass(frozen=True)
class CheckpointManifest:
    """The completion marker of a checkpoint and what a load checks against."""

    step: int  # steps done when it was saved: the data position to resume at
    world_size: int
    mesh: tuple[int, ...]
    model_digest: str  # state-dict names, global shapes, dtypes
    layout_digest: str  # their placements (informational: DCP reshards on load)
    plan_digest: str  # the current plan's digest at save time ("" if none)
    files: tuple[tuple[str, int, int], ...]  # (path inside the directory, bytes, crc32)
    extra: dict = field(default_factory=dict)  # the caller's JSON values (e.g. a sampler's state)
    torch_version: str = torch.__version__
    format: int = FORMAT

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: Any, path: str) -> "CheckpointManifest":
        try:
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, this autopar reads {FORMAT}")
            return CheckpointManifest(**{**data, "mesh": tuple(data["mesh"]),
                               "files": tuple((str(f), int(n), int(c)) for f, n, c in data["files"])})
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint manifest {path} is not one autopar wrote ({e}); resume from another "
                                  "checkpoint", path) from None


# ---- discovery --------------------------------------------------------------------------
def checkpoint_dir(root: "str | os.PathLike", step: int) -> str:
    return os.path.join(os.fspath(root), f"step-{step:08d}")


def complete_checkpoints(root: "str | os.PathLike") -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under root, oldest first: named
    `step-N` (renamed, so finished) and holding a manifest. Temp directories are skipped."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _COMPLETE.match(name)
        if m and os.path.isfile(os.path.join(root, name, MANIFEST)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_checkpoint(root: "str | os.PathLike") -> Optional[str]:
    """The newest complete checkpoint under root, or None (a fresh start)."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


# ---- save -------------------------------------------------------------------------------
def save_training_checkpoint(pm: ShardedModel, optimizer: Any, root: "str | os.PathLike", step: int, *,
                             keep: Optional[int] = 2, extra: Optional[dict] = None) -> str:
    """Save model shards, optimiser state, `step` and the RNGs of every rank under
    root/step-N, atomically (see the module docstring); every rank calls it. Keeps the
    newest `keep` checkpoints (None: all). Returns the checkpoint's path."""
    _check_save_arguments(step, keep, extra)
    _require_plan(pm, "saving")
    rank, world = dist.get_rank(), dist.get_world_size()
    final = checkpoint_dir(root, step)
    temp = f"{final}{_TEMP}{_broadcast(uuid.uuid4().hex[:8] if rank == 0 else None)}"  # 1.
    try:  # 2.
        dcp.save(training_entries(pm, optimizer, rank), checkpoint_id=temp)
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP raised on every rank: none renames
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint step {step} into {temp} failed ({_reason(e)}); it was "
                              f"not completed, and {latest_checkpoint(root) or 'no earlier checkpoint'} is still "
                              "the latest", temp) from e
    names = _broadcast(_files(temp) if rank == 0 else None)  # 3.
    facts = _gather(_facts(temp, names[rank::world]))
    problem = next((f for f in facts if isinstance(f, str)), None)
    if rank == 0 and problem is None:  # 4.
        manifest = _manifest(pm, step, world, sorted(f for part in facts for f in part), extra or {})
        problem = _complete(temp, final, manifest)
    problem = _broadcast(problem)
    if problem:
        raise CheckpointError(problem, temp)
    if rank == 0:  # 5.
        _prune(os.fspath(root), keep, keep_path=final)
    return final


def _check_save_arguments(step: int, keep: Optional[int], extra: Optional[dict]) -> None:
    """Checked on every rank before any collective, so all refuse alike."""
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step={step!r}: pass the number of steps done (an int >= 0); it is where a resume "
                              "continues")
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep={keep} would delete the checkpoint just written; pass keep >= 1, or None to "
                              "keep every checkpoint")
    try:
        json.dumps(extra or {})
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra={extra!r} cannot be written to the JSON manifest ({e}); pass JSON values "
                              "(numbers, strings, lists, dicts)") from None


def _manifest(pm: ShardedModel, step: int, world: int, files: list, extra: dict) -> CheckpointManifest:
    current = getattr(pm, "current", None)
    return CheckpointManifest(
        step=step, world_size=world, mesh=tuple(pm.mesh.shape), model_digest=model_digest(pm),
        layout_digest=_digest((n, str(s)) for n, s in sorted(pm.state_specs.items())),
        plan_digest=current.plan.digest() if current is not None else "", files=tuple(files), extra=dict(extra))


def _complete(temp: str, final: str, manifest: CheckpointManifest) -> Optional[str]:
    """Rank 0: marker, then rename; the error message, or None."""
    try:
        write_json_atomic(os.path.join(temp, MANIFEST), manifest.to_dict())
        aside = None
        if os.path.exists(final):  # the same step saved again (another run in this root): swap whole
            aside = f"{final}{_TEMP}replaced-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
        os.rename(temp, final)
        _fsync_dir(os.path.dirname(final))
        if aside:
            shutil.rmtree(aside, ignore_errors=True)
    except OSError as e:
        return (f"completing checkpoint {final} failed ({e}); {temp} stays incomplete and is ignored; check the "
                "file system (space, permissions) and save again")
    return None


def _prune(root: str, keep: Optional[int], keep_path: str) -> None:
    """Rank 0, after a complete save: older checkpoints beyond `keep`, and temp
    directories of saves that did not finish (none is running: all ranks are here)."""
    complete = [p for _, p in complete_checkpoints(root)]
    doomed = [p for p in (complete[:-keep] if keep else []) if p != keep_path]
    doomed += [os.path.join(root, n) for n in os.listdir(root) if _TEMP in n]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)


# ---- load -------------------------------------------------------------------------------
def load_training_checkpoint(pm: ShardedModel, optimizer: Any, path: "str | os.PathLike") -> CheckpointManifest:
    """Restore model shards, optimiser state (optimizer=None skips it) and this rank's
    RNGs from a complete checkpoint; every rank calls it with the same path. Returns its
    manifest (manifest.step is where to continue). A checkpoint that is incomplete,
    damaged or made for another world size, mesh or model raises CheckpointError on
    every rank, before anything is changed."""
    path = os.fspath(path)
    _require_plan(pm, "loading")
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest, problem = None, None
    try:
        manifest = _checked_manifest(pm, path, world)
        problem = _verify_files(path, manifest.files[rank::world])
    except CheckpointError as e:
        problem = str(e)
    problems = [p for p in _gather(problem) if p]
    if problems:
        raise CheckpointError(problems[0], path)
    try:
        reader = dcp.FileSystemReader(path)
        targets = load_targets(pm, optimizer, reader.read_metadata(), rank, path)
        dcp.load(targets, storage_reader=reader)
    except CheckpointError:
        raise
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP's (a BaseException), named
        raise CheckpointError(f"reading checkpoint {path} failed ({_reason(e)}); it is damaged or was "
                              "not written by save_training_checkpoint: resume from an earlier one", path) from e
    restore(pm, optimizer, targets, rank, path)
    pm.loaded = True
    _warn_if_replanned(pm, manifest, path)
    return manifest


def resume(pm: ShardedModel, optimizer: Any, root: "str | os.PathLike") -> Optional[CheckpointManifest]:
    """Load the newest complete checkpoint under root on every rank (rank 0 chooses,
    all follow); None when there is none yet (start from step 0)."""
    path = _broadcast(latest_checkpoint(root) if dist.get_rank() == 0 else None)
    return None if path is None else load_training_checkpoint(pm, optimizer, path)


def _warn_if_replanned(pm: ShardedModel, manifest: CheckpointManifest, path: str) -> None:
    current = getattr(pm, "current", None)
    now = current.plan.digest() if current is not None else ""
    if manifest.plan_digest and now and now != manifest.plan_digest:
        warnings.warn(PlanChangedWarning(
            f"checkpoint {path} was saved under plan {manifest.plan_digest}, this run uses {now} (other options or "
            "cost model?): weights and optimiser state are restored exactly, but the steps that follow run other "
            "per-rank programs and will not be bit-identical to the run that saved it"), stacklevel=3)


def model_digest(pm: ShardedModel) -> str:
    """What must match for a checkpoint to fit: names, global shapes and dtypes."""
    return _digest((n, tuple(s.meta.shape), str(s.meta.dtype)) for n, s in sorted(pm.state_specs.items()))


def _checked_manifest(pm: ShardedModel, path: str, world: int) -> CheckpointManifest:
    if not os.path.isdir(path):
        raise CheckpointError(f"no checkpoint directory {path}; latest_checkpoint(root) names the newest "
                              "complete one", path)
    marker = os.path.join(path, MANIFEST)
    if _TEMP in os.path.basename(path) or not os.path.isfile(marker):
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no {MANIFEST} (its save never finished, "
                              "or the marker was removed) or it is a temp directory; resume from a complete one "
                              "(latest_checkpoint(root) skips incomplete ones)", path)
    try:
        with open(marker) as f:
            manifest = CheckpointManifest.from_dict(json.load(f), marker)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint manifest {marker} is unreadable ({e}); resume from another "
                              "checkpoint", path) from None
    if (manifest.world_size, tuple(manifest.mesh)) != (world, tuple(pm.mesh.shape)):
        raise CheckpointError(f"checkpoint {path} was saved by {manifest.world_size} ranks on mesh "
                              f"{tuple(manifest.mesh)}; this run has {world} ranks on mesh {tuple(pm.mesh.shape)}. "
                              "Resume with the same world size and mesh (each rank restores its own RNG "
                              "states)", path)
    if manifest.model_digest != model_digest(pm):
        raise CheckpointError(f"checkpoint {path} was saved from another model (state names, shapes or dtypes "
                              "differ); resume the model it was saved from", path)
    return manifest


def _verify_files(path: str, files: tuple) -> Optional[str]:
    for name, size, crc in files:
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"checkpoint {path} is missing its file {name}; it is damaged: resume from another checkpoint"
        try:
            fact = _fact(path, name)
        except OSError as e:
            return f"checkpoint {path}: {name} cannot be read ({e}); resume from another checkpoint"
        if fact[1] != size:
            return (f"checkpoint {path}: {name} has {fact[1]} bytes, the manifest says {size} (truncated or "
                    "overwritten); it is damaged: resume from another checkpoint")
        if fact[2] != crc:
            return (f"checkpoint {path}: {name} fails its crc32 check (its bytes changed after the save); it is "
                    "damaged: resume from another checkpoint")
    return None


# ---- small parts --------------------------------------------------------------------------
def _require_plan(pm: ShardedModel, doing: str) -> None:
    if not pm.state_specs:
        raise CheckpointError(f"{doing} a training checkpoint needs the model's shard layouts, which the first "
                              "plan fixes: compile with example inputs (autopar.compile(model, args, kwargs, "
                              "mesh=...)) or call pm.prepare(args, kwargs) first")


def _files(folder: str) -> list[str]:
    out = []
    for here, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(here, n), folder) for n in names]
    return sorted(n for n in out if n != MANIFEST)


def _facts(folder: str, names: list[str]) -> "list[tuple[str, int, int]] | str":
    """(name, bytes, crc32) of each file, or what went wrong reading them."""
    try:
        return [_fact(folder, n) for n in names]
    except OSError as e:
        return f"checksumming the new checkpoint {folder} failed ({e}); it stays incomplete and is ignored"


def _fact(folder: str, name: str) -> tuple[str, int, int]:
    crc, size = 0, 0
    with open(os.path.join(folder, name), "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return name, size, crc


def _reason(e: BaseException) -> str:
    """'rank 1: OSError: disk full' for each failing rank of a DCP error, else 'Type: text'."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        excs = {r: f[0] if isinstance(f, tuple) else f for r, f in failures.items()}  # (exception, traceback)
        return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(excs.items()))
    return f"{type(e).__name__}: {e}"


def _digest(items) -> str:
    return hashlib.sha256(repr(list(items)).encode()).hexdigest()[:16]


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
