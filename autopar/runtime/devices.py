"""Where a ParallelModule runs: the model's one device (or meta, planned without weights),
and every call's inputs on it."""

from __future__ import annotations

import torch
from torch import nn

from autopar.core.errors import InputMismatchError, MeshError


def model_device(model: nn.Module, materialize_on: "torch.device | str | None") -> tuple[torch.device, bool]:
    """Where this rank runs, and whether the model is on meta (planned without weights;
    each rank then reads only its own shards onto `materialize_on`)."""
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        raise MeshError(f"model {type(model).__name__} has parameters on several devices {sorted(map(str, devices))}; "
                        "move it to one device (model.to(device)) before compiling")
    device = next(iter(devices)) if devices else torch.device("cpu")
    if device.type == "meta":
        return torch.device(materialize_on or "cpu"), True
    return device, False


def check_devices(tensors: list[torch.Tensor], device: torch.device) -> None:
    """Every input tensor on the model's device, else an InputMismatchError naming it."""
    for i, t in enumerate(tensors):
        if t.device != device:
            raise InputMismatchError(f"input tensor #{i} (shape {tuple(t.shape)}) is on {t.device} but the model "
                                     f"is on {device}; move inputs to the model's device")
