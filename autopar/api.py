"""The public entry points: compile (run on a mesh) and plan (offline)."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from autopar.core.mesh import Mesh
from autopar.core.options import Options
from autopar.passes.planning import options_with, plan  # noqa: F401 - plan is re-exported
from autopar.runtime.module import ParallelModule

__all__ = ["compile", "plan"]


def compile(model: nn.Module, args: Optional[tuple] = None, kwargs: Optional[dict] = None, *,
            mesh: Any, options: Optional[Options] = None, plan: Any = None,
            materialize_on: Any = None, **option_overrides: Any) -> ParallelModule:
    """Parallelise `model` over `mesh` on the initialised process group.

    Without `args`/`kwargs` it is traced and planned at the first call (per input
    signature); with them, now. `plan` (a Plan or a JSON path) skips solving: it must
    have been made for this model and input shapes (checked by graph fingerprint).
    A model on the meta device is planned without weights; its shards are then read
    per rank with pm.load_safetensors / load_full_state_dict / load_checkpoint onto
    `materialize_on` (default cpu). Keyword overrides go to Options (device=..., training=...).
    """
    opts = options_with(options, option_overrides)
    pm = ParallelModule(model, Mesh.of(mesh), opts, plan, materialize_on)
    if args is not None or kwargs is not None:
        if args is not None and not isinstance(args, (tuple, list)):
            args = (args,)
        pm.prepare(tuple(args or ()), kwargs or {})
    return pm
