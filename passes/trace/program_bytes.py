"""An exported program as bytes and back: what rank 0 ships to the other ranks
(runtime/shipping.py), so every rank runs the program rank 0 traced and planned.

torch.export's own serialiser carries every node in order with its name, target,
arguments, meta["val"], stack trace and module path, higher-order ops and symbolic
shapes. Weights do not travel: each rank has its own copy of the model.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Optional

import torch
from torch import nn
from torch._export.serde import serialize as serde  # torch.export.save's layer below the file


def program_bytes(ep: Any) -> bytes:
    """`ep` (export_program's, before traced_program renames it) as bytes, without its
    weights: torch.export's own serialiser (what torch.export.save writes: every node in
    order with its name, target, arguments, meta["val"], stack trace and module path;
    higher-order ops; symbolic shapes) kept as its schema objects and pickled rather than
    as its JSON, whose decoding costs about three times as much. Parameters and buffers
    travel as meta stand-ins (shape and dtype only); the lifted tensor constants, which
    are small, travel on the CPU."""
    program = serde.ExportedProgramSerializer().serialize(
        ep, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False)
    stand_ins = {k: _meta_like(v) for k, v in ep.state_dict.items()}
    constants = {k: (v.device.type, v.detach().to("cpu", copy=True) if v.device.type != "meta" else _meta_like(v))
                 for k, v in ep.constants.items()}
    return pickle.dumps((program.exported_program, stand_ins, constants))


def load_program(data: bytes, device: Optional[torch.device] = None) -> Any:
    """The ExportedProgram program_bytes wrote (parameters and buffers on meta). Lifted
    constants go back to the CPU or meta as they were, and to `device` (this rank's)
    where they were on another rank's accelerator."""
    program, stand_ins, constants = pickle.loads(data)  # noqa: S301 - rank 0 of our own process group
    placed = {k: t if kind in ("cpu", "meta") else t.to(device or kind) for k, (kind, t) in constants.items()}
    # torch warns on every rank of a range whose symbol the graph dropped: nothing to act on
    log, level = logging.getLogger(serde.__name__), logging.getLogger(serde.__name__).level
    log.setLevel(logging.ERROR)
    try:
        return serde.ExportedProgramDeserializer().deserialize(program, stand_ins, placed)
    finally:
        log.setLevel(level)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    empty = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
