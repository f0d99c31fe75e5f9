"""State of a pipelined model: full state dicts under the original model's names, and
the view of a rank's stages that training checkpoints (autopar/runtime/resume.py) save.

torch's pipeline() split keeps each stage module's parameters under their qualified
names in the original model (older torch replaced '.' with '_'; original_name maps
both), and may alias a tied parameter into several stages (GPT-2's lm_head.weight is in
the first and the last). So:

1. full_state_dict: each rank gathers its stages' shards whole over their sub-mesh
   (ParallelModule.full_state_dict), renames them to the original names, and the
   pipeline axis exchanges them; a name several stages hold (a tied copy, equal after
   sync_tied_grads) is taken from the lowest stage whose program reads it (torch also
   aliases lm_head.weight into the first stage, whose program never reads it: that copy
   never trains). State no stage reads comes from the
   original model as it was when split. Every rank ends with the whole dict, in the
   original model's state-dict order.
2. load_full_state_dict: each stage loads its own names' blocks.
3. Checkpoints: the rank's stages are one ShardedModel (RankStages) whose names carry
   their stage ("s3.transformer.h.5.mlp.c_fc.weight"), so tied copies in two stages are
   two entries, and every key a rank saves is prefixed with its pipeline coordinate
   ("pipe1/model/...", "pipe1/optim/param_groups"): the ranks of one stage's sub-mesh
   write their DTensor blocks once, those of other stages never collide with them. A load
   reads only its coordinate's keys. The manifest records the split (pipeline_layout),
   and a checkpoint of another split is refused (the keys are per stage).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from autopar.core.errors import CheckpointError
from autopar.core.pipeline import PipelinePlan
from autopar.runtime.checkpoint_files import digest
from autopar.runtime.checkpoint_view import layout_digest
from autopar.runtime.train_state import load_targets, param_group_names, restore, training_entries

MODEL_PREFIXES = ("model/", "optim/")  # what a rank saves per stage; "rng/rank<r>" is per rank already


def original_name(stage_name: str, originals: dict[str, str]) -> str:
    """The original model's state-dict name of a stage module's; `originals` maps each
    original name and its '.'->'_' form to the original."""
    try:
        return originals[stage_name]
    except KeyError:
        raise CheckpointError(f"stage state {stage_name!r} matches no name of the original model's state dict; "
                              "torch's pipeline() named it in a way autopar does not know (check "
                              "torch/distributed/pipelining/_IR.py) and report it") from None


def name_table(model: nn.Module) -> dict[str, str]:
    """Original names, and the '.'->'_' names older torch gave split submodules' state.
    Non-persistent buffers (Llama's rotary inv_freq) are included: the split moves them
    into its stages as persistent ones."""
    names = list(model.state_dict()) + [n for n, _ in model.named_buffers() if n not in model.state_dict()]
    return {**{n.replace(".", "_"): n for n in names}, **{n: n for n in names}}


# ---- 1-2. full state dicts --------------------------------------------------------------
@torch.no_grad()
def gather_pipeline_state(stages: list[tuple[int, Any]], order: tuple[str, ...], originals: dict[str, str],
                          unread: dict[str, torch.Tensor], pipe_group: Any, read: dict[int, frozenset[str]]
                          ) -> dict[str, torch.Tensor]:
    """Step 1. `stages`: (stage index, its ParallelModule) of this rank; `read`: the state
    names each stage's split graph uses (read_names)."""
    mine: dict[str, tuple[tuple[bool, int], torch.Tensor]] = {}
    for index, pm in stages:
        for name, value in pm.full_state_dict().items():
            # a copy the stage never uses is stale
            _prefer(mine, original_name(name, originals), (name not in read[index], index), value.cpu())
    parts: list = [None] * dist.get_world_size(pipe_group)
    dist.all_gather_object(parts, mine, group=pipe_group)
    merged: dict[str, tuple[tuple[bool, int], torch.Tensor]] = {}
    for part in parts:
        for key, (rank, value) in part.items():
            _prefer(merged, key, rank, value)
    out = {}
    for name in order:
        out[name] = merged[name][1] if name in merged else unread[name].clone()
    return out


def _prefer(chosen: dict, key: str, rank: tuple[bool, int], value: torch.Tensor) -> None:
    """Keep the copy of `key` with the lowest rank (used before unused, then lower stage)."""
    if key not in chosen or rank < chosen[key][0]:
        chosen[key] = (rank, value)


@torch.no_grad()
def load_pipeline_state(stages: list[tuple[int, Any]], state_dict: dict[str, torch.Tensor],
                        originals: dict[str, str], unread: dict[str, torch.Tensor],
                        transient: dict[str, torch.Tensor]) -> None:
    """Step 2: each stage takes its names' blocks (a KeyError, on every rank before any
    loads, names any of the original model's the dict lacks).
    `transient`: the model's non-persistent buffers, which no state dict holds."""
    state_dict = {**transient, **state_dict}
    # every original name, not only this rank's stages': every rank refuses alike, before loading any
    missing = [n for n in dict.fromkeys(originals.values()) if n not in state_dict]
    if missing:
        raise KeyError(f"state dict lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}; it must hold every "
                       "parameter and buffer of the original model (the keys of model.state_dict())")
    for _, pm in stages:
        names = pm.source_model.state_dict()
        pm.load_full_state_dict({n: state_dict[original_name(n, originals)] for n in names})
    for name in unread:
        if name in state_dict:
            unread[name] = state_dict[name].detach().clone()


def read_names(stage: Any) -> frozenset[str]:
    """The state names a split stage module uses: those under the modules its graph calls
    and those it fetches (get_attr). torch's aliasing may add others (a tied lm_head.weight
    in the first stage) that nothing reads, so nothing trains."""
    nodes = list(stage.graph.nodes)
    calls = [n.target for n in nodes if n.op == "call_module"]
    fetched = {n.target for n in nodes if n.op == "get_attr"}
    return frozenset(n for n in stage.state_dict() if n in fetched or any(n.startswith(f"{c}.") for c in calls))


# ---- 3. checkpoints ------------------------------------------------------------------------
class RankStages:
    """This rank's stages as one ShardedModel (autopar/runtime/state.py) for the checkpoint
    code: state names prefixed by the stage ("s<k>."); mesh, groups and device are the
    stages' sub-mesh's (every stage of a rank shares them)."""

    def __init__(self, stages: list[tuple[int, Any]]) -> None:
        first = stages[0][1]
        self.mesh, self.coords, self.comms = first.mesh, first.coords, first.comms
        self.device, self.device_mesh, self.source_model = first.device, first.device_mesh, None
        self.state_specs = {f"s{k}.{n}": s for k, pm in stages for n, s in pm.state_specs.items()}
        self.state_tensors = {f"s{k}.{n}": t for k, pm in stages for n, t in pm.state_tensors.items()}
        self.loaded = True


def pipeline_layout(plan: PipelinePlan) -> dict:
    """What a checkpoint's keys depend on: the axis, the schedule and each stage's blocks and rank."""
    return {"axis": plan.axis, "schedule": plan.schedule.value, "container": plan.container,
            "stages": [[s.first, s.stop, s.rank] for s in plan.stages]}


class PipelineCheckpoint:
    """The save/load entries of one rank of a pipelined model (step 3): a CheckpointView
    (autopar/runtime/checkpoint_view.py)."""

    def __init__(self, stages: list[tuple[int, Any]], mesh: Any, coordinate: int, plan: PipelinePlan,
                 state_meta: tuple, plan_digest: str) -> None:
        self.mesh, self.shards = mesh, RankStages(stages)  # the whole mesh (the manifest's); the stages' sub-mesh
        self.prefix = f"pipe{coordinate}/"
        self.layout = pipeline_layout(plan)
        self._digests = (digest(state_meta), layout_digest(self.shards), plan_digest)

    def _own(self, key: str) -> bool:
        return key.startswith(MODEL_PREFIXES)

    def require_plan(self, doing: str) -> None:
        """A pipelined model's stages are planned when it is built."""

    def entries(self, optimizer: Any, rank: int) -> dict[str, Any]:
        return {self.prefix + k if self._own(k) else k: v
                for k, v in training_entries(self.shards, optimizer, rank).items()}

    def targets(self, optimizer: Any, metadata: Any, rng_rank: int, path: str) -> dict[str, Any]:
        """load_targets over this coordinate's keys only, prefixed back for dcp.load."""
        mine = {k[len(self.prefix):]: md for k, md in metadata.state_dict_metadata.items() if k.startswith(self.prefix)}
        mine.update({k: md for k, md in metadata.state_dict_metadata.items() if not k.startswith("pipe")})
        own = load_targets(self.shards, optimizer, SimpleNamespace(state_dict_metadata=mine), rng_rank, path)
        return {self.prefix + k if self._own(k) else k: v for k, v in own.items()}

    def restore(self, optimizer: Any, loaded: dict[str, Any], rng_rank: int, path: str) -> None:
        restore(self.shards, optimizer, {k[len(self.prefix):] if k.startswith(self.prefix) else k: v
                                         for k, v in loaded.items()}, rng_rank, path)

    def group_names(self, optimizer: Any) -> list[list[Any]]:
        return param_group_names(self.shards, optimizer)

    def recorded_groups(self, optimizer: Any) -> list:
        """Every rank's groups (each holds its own stages' parameters), rank by rank."""
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, self.group_names(optimizer))
        return out

    def own_groups(self, recorded: list) -> list:
        return recorded[dist.get_rank()]

    def check_layout(self, saved: Optional[dict], path: str) -> None:
        """The keys are per stage: a checkpoint of another split cannot be read."""
        if saved != self.layout:
            raise CheckpointError(f"checkpoint {path} was saved with pipeline stages {saved} (None: not pipelined); "
                                  f"this run has {self.layout}. Resume with the same split: pass the saving run's "
                                  "plan (plan=...) with the same mesh, pipeline_axis and pipeline_schedule", path)

    def digests(self) -> tuple[str, str, str]:
        return self._digests
