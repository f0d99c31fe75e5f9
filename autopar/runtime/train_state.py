"""What a training checkpoint holds, as one flat dict for torch.distributed.checkpoint
(DCP), and how each part goes back into the model, the optimiser and the RNGs.

    "model/<name>"        this rank's shard of a parameter or buffer, as a DTensor
    "optim/<name>/<key>"  an optimiser state of that parameter: a DTensor laid out like the
                          parameter when it has the shard's shape (exp_avg, momentum_buffer),
                          a plain tensor when it is a scalar (Adam's step), else an object
    "optim/param_groups"  the hyperparameters, with the parameters named (one object)
    "rng/rank<r>"         this rank's torch CPU, python `random` and CUDA RNG states

The optimiser works on this rank's shards as ordinary nn.Parameters and knows nothing of
the mesh; the parameter's Spec says how its elementwise states are laid out, so DCP
stores each distinct block once (replicas deduplicated) and the checkpoint reads as whole
tensors. Scalar states must be equal on every rank (Adam's step count is): DCP keeps one
copy of a plain tensor. Keys split at "/", which no state-dict name contains, so a key
names its parameter and state unambiguously. A fresh optimiser holds no state to load
into, so load targets are built from the checkpoint's own metadata.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from autopar.core.errors import CheckpointError
from autopar.runtime.state import (ShardedModel, checkpoint_target, from_checkpoint, sharded_state_dict, to_checkpoint,
                                   unique_shards)

GROUPS_KEY = "optim/param_groups"


def rng_key(rank: int) -> str:
    return f"rng/rank{rank}"


def training_entries(pm: ShardedModel, optimizer: Any, rank: int) -> dict[str, Any]:
    """Everything a rank saves: its model shards, its optimiser states, its RNG states."""
    out: dict[str, Any] = {f"model/{name}": dt for name, dt in sharded_state_dict(pm).items()}
    if optimizer is not None:
        out.update(_optimizer_entries(pm, optimizer))
    out[rng_key(rank)] = _rng_states()
    return out


def load_targets(pm: ShardedModel, optimizer: Any, metadata: Metadata, rng_rank: int, path: str) -> dict[str, Any]:
    """Tensors (and placeholders for objects) of the right shapes for dcp.load to fill:
    fresh ones, not the live shards, so a load that fails halfway changes nothing."""
    out: dict[str, Any] = {f"model/{name}": checkpoint_target(spec, pm, pm.state_tensors[name].dtype)
                           for name, spec in pm.state_specs.items()}
    if optimizer is not None:
        if GROUPS_KEY not in metadata.state_dict_metadata:
            raise CheckpointError(f"checkpoint {path} holds no optimiser state; resume with optimizer=None to "
                                  "load the model alone, or resume from a checkpoint saved with the optimiser", path)
        for key, md in metadata.state_dict_metadata.items():
            if key.startswith("optim/") and key != GROUPS_KEY:
                out[key] = _optimizer_target(pm, key, md, path)
        out[GROUPS_KEY] = None
    out[rng_key(rng_rank)] = None
    return out


def restore(pm: ShardedModel, optimizer: Any, loaded: dict[str, Any], rng_rank: int, path: str) -> None:
    """Copy what dcp.load filled into the shards, the optimiser and the RNGs (those saved by
    rank `rng_rank`; last: nothing after it may draw); the optimiser's groups are checked
    before anything is copied."""
    state = _optimizer_state_dict(pm, optimizer, loaded, path) if optimizer is not None else None  # may refuse
    with torch.no_grad():
        for name, spec in pm.state_specs.items():
            pm.state_tensors[name].copy_(from_checkpoint(loaded[f"model/{name}"].to_local(), spec, pm))
    if optimizer is not None:
        optimizer.load_state_dict(state)
    _set_rng_states(loaded[rng_key(rng_rank)])


# ---- optimiser ------------------------------------------------------------------------
def _names_by_id(pm: ShardedModel) -> dict[int, str]:
    return {id(t): name for name, t, _ in unique_shards(pm)}


def param_group_names(pm: ShardedModel, optimizer: Any) -> list[list[Any]]:
    """The state-dict name of each parameter of each optimiser group (None: not a shard of pm)."""
    names = _names_by_id(pm)
    return [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _optimizer_entries(pm: ShardedModel, optimizer: Any) -> dict[str, Any]:
    names = _names_by_id(pm)
    params = _optimizer_params(optimizer)
    foreign = [tuple(p.shape) for p in params if id(p) not in names]
    if foreign:
        raise CheckpointError(f"the optimiser holds {len(foreign)} tensors (shapes {foreign[:3]}) that are not "
                              "shards of this ParallelModule; build it over pm.parameters()")
    sd = optimizer.state_dict()
    out: dict[str, Any] = {}
    for index, states in sd["state"].items():
        param = params[index]
        name = names[id(param)]
        for key, value in states.items():
            out[f"optim/{name}/{key}"] = _state_entry(pm, name, key, param, value)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(params[i])] for i in g["params"]]}
              for g in sd["param_groups"]]
    out[GROUPS_KEY] = tuple(groups)  # a tuple is one object to DCP (a list would be walked)
    return out


def _state_entry(pm: ShardedModel, name: str, key: str, param: torch.Tensor, value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointError(f"optimiser state {key!r} of {name} has shape {tuple(value.shape)}, not its shard's "
                              f"{tuple(param.shape)}; only elementwise states (SGD momentum, Adam, AdamW, ...) and "
                              "scalars can be checkpointed shard by shard")
    return to_checkpoint(value.detach(), pm.state_specs[name], pm)


def _optimizer_target(pm: ShardedModel, key: str, md: Any, path: str) -> Any:
    _, name, state = key.split("/", 2)
    spec = pm.state_specs.get(name)
    if spec is None:
        raise CheckpointError(f"checkpoint {path} has optimiser state for {name}, which this model does not have; "
                              "it was saved from another model", path)
    if not isinstance(md, TensorStorageMetadata):
        return None  # an object: DCP puts it here
    dtype = md.properties.dtype
    if len(md.size) == 0:
        return torch.zeros((), dtype=dtype)
    if tuple(md.size) != tuple(spec.meta.shape):
        raise CheckpointError(f"checkpoint {path}: optimiser state {state!r} of {name} has shape {tuple(md.size)}, "
                              f"the parameter's is {spec.meta.shape}", path)
    return checkpoint_target(spec, pm, dtype)


def _optimizer_state_dict(pm: ShardedModel, optimizer: Any, loaded: dict[str, Any], path: str) -> dict:
    """The optimiser's own state_dict format (states keyed by parameter index) from the
    named entries, after checking that its parameter groups are the saved ones."""
    names = _names_by_id(pm)
    index = {names.get(id(p)): i for i, p in enumerate(_optimizer_params(optimizer))}
    saved = list(loaded[GROUPS_KEY])
    current = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    if [g["params"] for g in saved] != current:
        raise CheckpointError(f"checkpoint {path} was saved by an optimiser over other parameter groups "
                              f"({[len(g['params']) for g in saved]} parameters per group; this one has "
                              f"{[len(g) for g in current]}); build the optimiser as the saving run did", path)
    state: dict[int, dict[str, Any]] = {}
    for key, value in loaded.items():
        if key.startswith("optim/") and key != GROUPS_KEY:
            _, name, what = key.split("/", 2)
            state.setdefault(index[name], {})[what] = (from_checkpoint(value.to_local(), pm.state_specs[name], pm)
                                                       if hasattr(value, "to_local") else value)
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in saved]
    return {"state": state, "param_groups": groups}


# ---- random number generators -----------------------------------------------------------
def _rng_states() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return (torch.get_rng_state(), random.getstate(), cuda)


def _set_rng_states(states: tuple) -> None:
    cpu, python, cuda = states
    torch.set_rng_state(cpu)
    random.setstate(python)
    if cuda is not None and torch.cuda.is_available():
        for device, state in enumerate(cuda[:torch.cuda.device_count()]):  # a rank may now see fewer devices
            torch.cuda.set_rng_state(state, device)
