"""The public entry points: compile (run on a mesh) and plan (offline)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from torch import nn

from autopar.mesh import Mesh
from autopar.options import Options
from autopar.planning import plan
from autopar.runtime import ParallelModule

__all__ = ["compile", "plan"]


def compile(model: nn.Module, args: Optional[tuple] = None, kwargs: Optional[dict] = None, *,
            mesh: Any, options: Optional[Options] = None, **option_overrides: Any) -> ParallelModule:
    """Parallelise `model` over `mesh` on the initialised process group.

    Without `args`/`kwargs` it is traced and planned at the first call (per input
    signature); with them, now. Keyword overrides go to Options (device=..., training=...).
    """
    opts = replace(options or Options(), **option_overrides)
    pm = ParallelModule(model, Mesh.of(mesh), opts)
    if args is not None or kwargs is not None:
        if args is not None and not isinstance(args, (tuple, list)):
            args = (args,)
        pm.prepare(tuple(args or ()), kwargs or {})
    return pm
