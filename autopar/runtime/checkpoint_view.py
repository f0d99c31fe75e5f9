"""What a training checkpoint reads and writes of one rank's model, the same questions
for every plan (autopar/runtime/resume.py asks them and never asks which kind of plan).

- ShardView: a ParallelModule running one program per signature; its state-dict names
  and DCP keys are the model's own.
- PipelineCheckpoint (autopar/runtime/pipeline_state.py): the stages a pipelined plan puts
  on this rank, their names and keys carrying the stage and the pipeline coordinate.

Each gives the DCP entries to save, the targets to load into, the restore after a
load, the digests and pipeline layout the manifest records, and the optimiser's
parameter groups (what the manifest records, and this rank's part of that record).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from autopar.core.errors import CheckpointError
from autopar.core.mesh import Mesh
from autopar.runtime.checkpoint_files import digest
from autopar.runtime.state import ShardedModel
from autopar.runtime.train_state import load_targets, param_group_names, restore, training_entries


class CheckpointView(Protocol):
    mesh: Mesh  # the whole mesh (what the manifest records)
    layout: Optional[dict]  # a pipelined plan's split (pipeline_state.pipeline_layout), else None

    def require_plan(self, doing: str) -> None: ...
    def entries(self, optimizer: Any, rank: int) -> dict[str, Any]: ...
    def targets(self, optimizer: Any, metadata: Any, rng_rank: int, path: str) -> dict[str, Any]: ...
    def restore(self, optimizer: Any, loaded: dict[str, Any], rng_rank: int, path: str) -> None: ...
    def recorded_groups(self, optimizer: Any) -> list: ...
    def own_groups(self, recorded: list) -> list: ...
    def group_names(self, optimizer: Any) -> list[list[Any]]: ...
    def check_layout(self, saved: Optional[dict], path: str) -> None: ...
    def digests(self) -> tuple[str, str, str]: ...


def model_digest(pm: ShardedModel) -> str:
    """What must match for a checkpoint to fit: names, global shapes and dtypes."""
    return digest((n, tuple(s.meta.shape), str(s.meta.dtype)) for n, s in sorted(pm.state_specs.items()))


def layout_digest(pm: ShardedModel) -> str:
    """The shards' layouts (one plan's choice; another plan on the same mesh may differ)."""
    return digest((n, str(s)) for n, s in sorted(pm.state_specs.items()))


class ShardView:
    """A ParallelModule's shards and the optimiser over them, under the model's names."""

    layout = None

    def __init__(self, pm: Any) -> None:
        self.pm, self.mesh = pm, pm.mesh

    def require_plan(self, doing: str) -> None:
        if not self.pm.state_specs:
            raise CheckpointError(f"{doing} a training checkpoint needs the model's shard layouts, which the first "
                                  "plan fixes: compile with example inputs (autopar.compile(model, args, kwargs, "
                                  "mesh=...)) or call pm.prepare(args, kwargs) first")

    def entries(self, optimizer: Any, rank: int) -> dict[str, Any]:
        return training_entries(self.pm, optimizer, rank)

    def targets(self, optimizer: Any, metadata: Any, rng_rank: int, path: str) -> dict[str, Any]:
        return load_targets(self.pm, optimizer, metadata, rng_rank, path)

    def restore(self, optimizer: Any, loaded: dict[str, Any], rng_rank: int, path: str) -> None:
        restore(self.pm, optimizer, loaded, rng_rank, path)
        self.pm.loaded = True

    def group_names(self, optimizer: Any) -> list[list[Any]]:
        return param_group_names(self.pm, optimizer)

    def recorded_groups(self, optimizer: Any) -> list:
        return self.group_names(optimizer)  # every rank holds every parameter's name

    def own_groups(self, recorded: list) -> list:
        return recorded

    def check_layout(self, saved: Optional[dict], path: str) -> None:
        if saved is not None:
            raise CheckpointError(f"checkpoint {path} was saved by a pipelined model (stages {saved}); resume it "
                                  "with the same pipeline_axis, pipeline_schedule and plan", path)

    def digests(self) -> tuple[str, str, str]:
        """(model, layout, plan) digests for the manifest; the plan's is "" before any plan."""
        current = self.pm.current
        return model_digest(self.pm), layout_digest(self.pm), current.plan.digest() if current is not None else ""
