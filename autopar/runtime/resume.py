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
   completion marker. Checkpoints of later steps (a rollback, or another run in this
   root) are renamed aside to `step-M.stale-<token>` with a warning, so the newest
   checkpoint is the one just saved. Then it renames the directory to `step-N` (atomic
   on POSIX) and fsyncs the parent.
5. Only now, with the new checkpoint complete, rank 0 deletes checkpoints older than
   the newest `keep` (each renamed to a temp name first, so a crash mid-delete leaves
   no `step-N` with missing files) and temp directories of saves that never finished.
Every step only rank 0 does runs through _on_rank0: its outcome is broadcast, so an
error there raises the same CheckpointError on every rank (a failed save's temp
directory is removed).

Loading: every rank reads the manifest (a directory without one is refused), checks
world size, mesh and model against it, and verifies bytes and crc32 of its share of the
files; the ranks exchange what they found, so all raise the same CheckpointError or none
does. Then dcp.load fills shards, optimiser and RNGs. `resume` lets rank 0 choose the
newest complete checkpoint and broadcasts its path, so all ranks load the same one even
if a save completes while they look.

What must match: the model (names, shapes, dtypes) and the optimiser's parameter groups.
Another plan on the same mesh only warns (PlanChangedWarning): DCP reshards weights and
optimiser states exactly, but the continuation runs other programs, so it is not
bit-identical. Another world size or mesh warns too (WorldChangedWarning;
autopar/runtime/world_change.py says what carries over), except for a pipelined model.

Why: torchrun's elastic agent restarts the whole group after a lost rank, at any moment
of a save. The restarted group must find a checkpoint that is whole and must continue as
if it was never stopped: same weights, optimiser moments, data position (the step) and
random draws. Every collective here runs on the default process group, under the
timeout it was initialised with, so a dead peer turns into an error, not a hang.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from autopar.core.errors import CheckpointError
from autopar.core.files import write_json_atomic
from autopar.runtime.checkpoint_files import (MANIFEST, CheckpointManifest, checkpoint_dir, complete_checkpoints,
                                              file_facts, fsync_dir, latest_checkpoint, list_files,
                                              verify_files)
from autopar.runtime.checkpoint_view import CheckpointView
from autopar.runtime.world_change import DataPosition, check_world, data_mismatch, rng_source, warn_world_changed

_TEMP = ".tmp-"
_STALE = ".stale-"  # a later step's checkpoint set aside by a save of an earlier step


class PlanChangedWarning(UserWarning):
    """A checkpoint is resumed under another plan than the one it was saved under."""


# ---- save -------------------------------------------------------------------------------
def save_training_checkpoint(pm: Any, optimizer: Any, root: "str | os.PathLike", step: int, *,
                             keep: Optional[int] = 2, extra: Optional[dict] = None,
                             data: Optional[DataPosition] = None) -> str:
    """Save model shards, optimiser state, `step` and the RNGs of every rank under
    root/step-N, atomically (see the module docstring); every rank calls it. Keeps the
    newest `keep` checkpoints (None: all). `data`: a data position (an ElasticSampler,
    or anything with state_dict/load_state_dict of JSON values) recorded in the manifest.
    Returns the checkpoint's path."""
    position = data.state_dict() if data is not None else None
    _check_save_arguments(step, keep, extra, position)
    view = _view(pm)
    view.require_plan("saving")
    rank, world = dist.get_rank(), dist.get_world_size()
    root, final = os.fspath(root), checkpoint_dir(root, step)
    temp = f"{final}{_TEMP}{_broadcast(uuid.uuid4().hex[:8] if rank == 0 else None)}"  # 1.
    try:  # 2.
        dcp.save(view.entries(optimizer, rank), checkpoint_id=temp)
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP raised on every rank: none renames
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise CheckpointError(f"saving checkpoint step {step} into {temp} failed ({_reason(e)}); it was "
                              f"not completed, and {latest_checkpoint(root) or 'no earlier checkpoint'} is still "
                              "the latest", temp) from e
    try:
        names = _on_rank0(f"listing the files of {temp}", temp, list_files, temp)  # 3.
        facts = _gather(file_facts(temp, names[rank::world]))
        problem = next((f for f in facts if isinstance(f, str)), None)
        if problem:
            raise CheckpointError(problem, temp)
        files = sorted(f for part in facts for f in part)
        groups = view.recorded_groups(optimizer) if optimizer is not None else None
        stale = _on_rank0(f"completing checkpoint {final}", temp,  # 4.
                          lambda: _complete(temp, final,
                                            _manifest(view, step, world, files, extra or {}, groups, position)))
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(temp, ignore_errors=True)
        raise
    if stale:
        warnings.warn(f"checkpoints {stale} under {root} are of later steps than the step {step} just saved (a "
                      "rollback, or another run in this root): they were renamed aside, not deleted, so resume "
                      f"continues from step {step}", stacklevel=2)
    _on_rank0(f"checkpoint {final} is complete, but removing checkpoints older than the newest keep={keep} "  # 5.
              f"under {root}", final, _prune, root, keep, final)
    return final


def _check_save_arguments(step: int, keep: Optional[int], extra: Optional[dict], position: Optional[dict]) -> None:
    """Checked on every rank before any collective, so all refuse alike."""
    if type(step) is not int or step < 0:
        raise CheckpointError(f"step={step!r}: pass the number of steps done (an int >= 0); it is where a resume "
                              "continues")
    if keep is not None and (type(keep) is not int or keep < 1):
        raise CheckpointError(f"keep={keep!r} must be an int >= 1 (a smaller one would delete the checkpoint just "
                              "written), or None to keep every checkpoint")
    if extra is not None and (not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra)):
        raise CheckpointError(f"extra={extra!r} must be a dict with str keys (it is stored as a JSON object, "
                              "whose keys are strings); pass e.g. extra={'epoch': 3}")
    try:
        json.dumps(extra or {}, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra={extra!r} cannot be written to the JSON manifest ({e}); pass JSON values "
                              "(numbers, strings, lists, dicts)") from None
    if position is not None:
        try:
            json.dumps(position, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"data= gave the state {position!r}, which cannot be written to the JSON manifest "
                                  f"({e}); a data position's state_dict() must hold JSON values") from None


def _on_rank0(doing: str, path: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a step only rank 0 does and hand every rank its result; if it raises, every
    rank raises the same CheckpointError (no peer is left waiting in a collective)."""
    outcome: Any = None
    if dist.get_rank() == 0:
        try:
            outcome = (fn(*args), None)
        except Exception as e:  # noqa: BLE001 - any failure must reach every rank, named
            outcome = (None, f"{doing} failed on rank 0 ({type(e).__name__}: {e}); check the file system "
                             "(space, permissions) and try again")
    value, problem = _broadcast(outcome)
    if problem:
        raise CheckpointError(problem, path)
    return value


def _manifest(view: CheckpointView, step: int, world: int, files: list, extra: dict,
              groups: Optional[list], position: Optional[dict]) -> CheckpointManifest:
    model, layout, plan = view.digests()
    return CheckpointManifest(
        step=step, world_size=world, mesh=tuple(view.mesh.shape), model_digest=model, layout_digest=layout,
        plan_digest=plan, files=tuple(files), extra=dict(extra),
        param_groups=None if groups is None else tuple(tuple(g) for g in groups), pipeline=view.layout,
        data=position)


def _complete(temp: str, final: str, manifest: CheckpointManifest) -> list[str]:
    """Rank 0: marker, then rename; checkpoints of later steps (another timeline) are
    renamed aside first. Returns their new names."""
    write_json_atomic(os.path.join(temp, MANIFEST), manifest.to_dict())
    root = os.path.dirname(final)
    stale = []
    for later, path in complete_checkpoints(root):
        if later > manifest.step:
            stale.append(f"{path}{_STALE}{uuid.uuid4().hex[:8]}")
            os.rename(path, stale[-1])
    aside = None
    if os.path.exists(final):  # the same step saved again (another run in this root): swap whole
        aside = f"{final}{_TEMP}replaced-{uuid.uuid4().hex[:8]}"
        os.rename(final, aside)
    os.rename(temp, final)
    fsync_dir(root)
    if aside:
        shutil.rmtree(aside, ignore_errors=True)
    return stale


def _prune(root: str, keep: Optional[int], keep_path: str) -> None:
    """Rank 0, after a complete save: older checkpoints beyond `keep`, and temp
    directories of saves that did not finish (none is running: all ranks are here). A
    checkpoint is first renamed to a temp name, so a crash while deleting it leaves an
    ignored temp directory, never a `step-N` with missing files."""
    complete = [p for _, p in complete_checkpoints(root)]
    doomed = [p for p in (complete[:-keep] if keep else []) if p != keep_path]
    for path in doomed:
        os.rename(path, f"{path}{_TEMP}deleting-{uuid.uuid4().hex[:8]}")
    if doomed:
        fsync_dir(root)
    for name in os.listdir(root):
        if _TEMP in name:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ---- load -------------------------------------------------------------------------------
def load_training_checkpoint(pm: Any, optimizer: Any, path: "str | os.PathLike", *,
                             data: Optional[DataPosition] = None) -> CheckpointManifest:
    """Restore model shards, optimiser state (optimizer=None skips it), the RNGs and, with
    `data`, the data position (a checkpoint saved without one is then refused: continuing
    an epoch from its start would repeat samples) from a complete checkpoint; every rank
    calls it with the same path. Returns its manifest (manifest.step is where to
    continue). A checkpoint that is incomplete, damaged or made for another model or
    optimiser raises CheckpointError on every rank, before anything is changed: dcp.load
    fills fresh tensors, copied into the model only once everything was read.

    Another world size or mesh (a non-pipelined model's) loads too, with one
    WorldChangedWarning: DCP reshards every weight and optimiser state onto this plan's
    layouts exactly, and rank r restores the RNG streams saved by rank r % (old world
    size), so the ranks that remain continue their own streams (world_change.py says
    what is and is not reproducible)."""
    path = os.fspath(path)
    view = _view(pm)
    view.require_plan("loading")
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest, problem, reader, targets = None, None, None, None
    try:
        manifest = _checked_manifest(view, optimizer, path, world)
        problem = verify_files(path, manifest.files[rank::world]) or data_mismatch(data, manifest, path)
        if problem is None:
            reader = dcp.FileSystemReader(path)
            metadata = reader.read_metadata()
            targets = view.targets(optimizer, metadata, rng_source(rank, manifest), path)
    except CheckpointError as e:
        problem = str(e)
    except Exception as e:  # noqa: BLE001 - an unreadable .metadata on one rank must reach every rank
        problem = (f"reading checkpoint {path} failed ({type(e).__name__}: {e}); it is damaged or was not written "
                   "by save_training_checkpoint: resume from an earlier one")
    seen = _gather((path, problem))
    problems = [p for _, p in seen if p]
    if len({p for p, _ in seen}) > 1:
        problems.insert(0, f"ranks were given different checkpoints ({sorted({p for p, _ in seen})}); pass every "
                           "rank the same path (resume(root) lets rank 0 choose for all)")
    if problems:
        raise CheckpointError(problems[0], path)
    try:
        dcp.load(targets, storage_reader=reader)
    except (Exception, dcp.CheckpointException) as e:  # noqa: BLE001 - DCP's (a BaseException), named
        raise CheckpointError(f"reading checkpoint {path} failed ({_reason(e)}); it is damaged or was "
                              "not written by save_training_checkpoint: resume from an earlier one", path) from e
    view.restore(optimizer, targets, rng_source(rank, manifest), path)
    if data is not None:  # its state was checked before anything was loaded
        data.load_state_dict(manifest.data)
    if manifest.world_size != world or tuple(manifest.mesh) != tuple(view.mesh.shape):
        warn_world_changed(manifest, world, tuple(view.mesh.shape), path, data is not None)
    else:
        _warn_if_replanned(view, manifest, path)
    return manifest


def resume(pm: Any, optimizer: Any, root: "str | os.PathLike", *, fallback: bool = False,
           data: Optional[DataPosition] = None) -> Optional[CheckpointManifest]:
    """Load the newest complete checkpoint under root on every rank (rank 0 chooses,
    all follow), with its data position into `data`; None when there is none yet (start
    from step 0). It may come from another world size (load_training_checkpoint):
    compile with mesh="auto" or mesh=lambda world: ... to re-plan for this one.
    fallback=True: when a checkpoint is refused (damaged, or made for another run), warn
    and try the next older one; a refused load changes nothing, so the one that loads is
    restored whole. CheckpointError if every one is refused."""
    root = os.fspath(root)
    if not fallback:
        path = _on_rank0(f"looking for checkpoints under {root}", root, latest_checkpoint, root)
        return None if path is None else load_training_checkpoint(pm, optimizer, path, data=data)
    paths = _on_rank0(f"looking for checkpoints under {root}", root,
                      lambda: [p for _, p in reversed(complete_checkpoints(root))])
    refused = []
    for path in paths:
        try:
            return load_training_checkpoint(pm, optimizer, path, data=data)
        except CheckpointError as e:  # raised alike on every rank, so all try the same next one
            refused.append(str(e))
            warnings.warn(f"resume(fallback=True): {e}; trying an older checkpoint", stacklevel=2)
    if refused:
        raise CheckpointError(f"none of the {len(refused)} complete checkpoints under {root} could be loaded; the "
                              f"newest was refused because: {refused[0]}", root)
    return None


def _warn_if_replanned(view: CheckpointView, manifest: CheckpointManifest, path: str) -> None:
    now = view.digests()[2]
    if manifest.plan_digest and now and now != manifest.plan_digest:
        warnings.warn(PlanChangedWarning(
            f"checkpoint {path} was saved under plan {manifest.plan_digest}, this run uses {now} (other options or "
            "cost model?): weights and optimiser state are restored exactly, but the steps that follow run other "
            "per-rank programs and will not be bit-identical to the run that saved it"), stacklevel=3)


def _checked_manifest(view: CheckpointView, optimizer: Any, path: str, world: int) -> CheckpointManifest:
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
    check_world(manifest, view.layout, world, tuple(view.mesh.shape), path)
    view.check_layout(manifest.pipeline, path)
    if manifest.model_digest != view.digests()[0]:
        raise CheckpointError(f"checkpoint {path} was saved from another model (state names, shapes or dtypes "
                              "differ); resume the model it was saved from", path)
    if optimizer is not None:
        _check_param_groups(manifest, view, view.group_names(optimizer), path)
    return manifest


def _check_param_groups(manifest: CheckpointManifest, view: CheckpointView, current: list, path: str) -> None:
    if manifest.param_groups is None:
        raise CheckpointError(f"checkpoint {path} holds no optimiser state; resume with optimizer=None to load the "
                              "model alone, or resume from a checkpoint saved with the optimiser", path)
    saved = [list(g) for g in view.own_groups(list(manifest.param_groups))]
    if saved != current:
        raise CheckpointError(f"checkpoint {path} was saved by an optimiser over other parameter groups "
                              f"({[len(g) for g in saved]} parameters per group; this one has "
                              f"{[len(g) for g in current]}, or other parameters); build the optimiser as the "
                              "saving run did", path)


# ---- small parts --------------------------------------------------------------------------
def _view(pm: Any) -> CheckpointView:
    """What a model checkpoints through (autopar/runtime/checkpoint_view.py)."""
    return pm.checkpoint_view()


def _reason(e: BaseException) -> str:
    """'rank 1: OSError: disk full' for each failing rank of a DCP error, else 'Type: text'."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        excs = {r: f[0] if isinstance(f, tuple) else f for r, f in failures.items()}  # (exception, traceback)
        return "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, x in sorted(excs.items()))
    return f"{type(e).__name__}: {e}"




def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value: Any) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
