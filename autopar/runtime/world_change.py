"""Resuming a training checkpoint on another world size or mesh (autopar/runtime/resume.py
asks these questions of a manifest; nothing here runs a collective).

What carries over exactly, whatever the new world:
- every weight, buffer and optimiser state: the checkpoint holds whole tensors (DCP
  DTensors), which load onto the new plan's layouts bit for bit;
- the step, the caller's `extra` and the data position (an ElasticSampler counts in
  global samples, so the same global batches follow);
- rank r's RNG streams (torch, python, CUDA) are those saved by rank r % (old world
  size): on a shrunk world every remaining rank continues its own streams, on a grown
  one the new ranks start from copies of the old ranks' streams.

What does not: the per-rank programs are the new plan's, so floating-point sums are
reduced in another order (losses agree to fp32 rounding, not bit for bit), and a random
op whose output is split over ranks (dropout on a rank's rows) draws its masks per rank,
so its draws after the change differ from an unchanged run's.

A pipelined model's checkpoint names its keys by pipeline coordinate, so it resumes
only on the world and mesh it was saved on.
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional, Protocol

import torch.distributed as dist

from autopar.core.errors import CheckpointError
from autopar.runtime.checkpoint_files import CheckpointManifest


class WorldChangedWarning(UserWarning):
    """A checkpoint is resumed on another world size or mesh than the one that saved it."""


class DataPosition(Protocol):
    """Where the data stream stands (autopar/runtime/data.py's ElasticSampler is one). An
    optional `mismatch(state) -> str | None` says why a state cannot be taken; without it
    a deep copy tries load_state_dict, so a refusal still comes before anything is loaded."""

    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def check_world(manifest: CheckpointManifest, layout: Optional[dict], world: int, mesh: tuple[int, ...],
                path: str) -> None:
    """Refuse a world change only where the checkpoint cannot follow it (pipelined keys)."""
    if (manifest.world_size, tuple(manifest.mesh)) == (world, mesh):
        return
    if manifest.pipeline is not None or layout is not None:
        which = "it was saved by a pipelined model" if manifest.pipeline is not None else "this model is pipelined"
        raise CheckpointError(f"checkpoint {path} was saved by {manifest.world_size} ranks on mesh "
                              f"{tuple(manifest.mesh)}; this run has {world} ranks on mesh {mesh}, and {which}: "
                              "a pipelined model's checkpoint is keyed by pipeline stage and rank, so it resumes "
                              "only on the world and mesh that saved it; resume there with the same pipeline", path)


def rng_source(rank: int, manifest: CheckpointManifest) -> int:
    """The saved rank whose RNG streams `rank` restores."""
    return rank % manifest.world_size


def data_mismatch(data: Optional[DataPosition], manifest: CheckpointManifest, path: str) -> Optional[str]:
    """Why `data` cannot take the checkpoint's data position, or None (checked before
    anything is loaded, so a refusal changes nothing)."""
    if data is None:
        return None
    if manifest.data is None:
        return (f"checkpoint {path} holds no data position; resume without data=, or from a checkpoint saved with "
                "save_training_checkpoint(..., data=sampler)")
    check = getattr(data, "mismatch", None)
    if check is not None:
        problem = check(manifest.data)
    else:
        try:
            copy.deepcopy(data).load_state_dict(manifest.data)
            problem = None
        except Exception as e:  # noqa: BLE001 - the object's own refusal, reported on every rank
            problem = f"{type(data).__name__}.load_state_dict refused the data position ({type(e).__name__}: {e})"
    return f"checkpoint {path}: {problem}" if problem else None


def warn_world_changed(manifest: CheckpointManifest, world: int, mesh: tuple[int, ...], path: str,
                       data_restored: bool) -> None:
    """One warning per load, from rank 0 (the other ranks would only repeat it)."""
    if dist.get_rank() != 0:
        return
    restored = "weights, optimiser state, step and data position" if data_restored else \
        "weights, optimiser state and step (no data= was given: the data position is yours to restore)"
    warnings.warn(WorldChangedWarning(
        f"checkpoint {path} was saved by {manifest.world_size} ranks on mesh {tuple(manifest.mesh)}; resuming on "
        f"{world} ranks on mesh {mesh}: {restored} are restored exactly, "
        f"rank r continues the RNG streams of saved rank r % {manifest.world_size}, and the steps that follow run "
        "this plan's programs (losses equal to fp32 rounding, not bit for bit)"), stacklevel=3)

