"""Rank programs through torch.compile (Options.compile).

The program's reshard steps run whole inside one autograd function each, on torch's
functional collectives (autopar/runtime/collectives.py), so Dynamo traces the program,
collectives included, into one graph (`fullgraph=True` by default) and AOTAutograd
derives the backward; Inductor then generates the kernels and may reorder the
collectives' waits itself. Where Inductor cannot run (no C++ compiler for CPU code, no
Triton for CUDA code), or its compilation fails, the program runs eagerly after one
warning that names the cause.

Options.cuda_graphs compiles with mode="reduce-overhead": torch's CUDA graph trees record
the compiled forward and backward once per shape and replay them, the NCCL collectives
inside, so a step costs a few launches instead of a Python dispatch per op. It needs the
rank's tensors on a CUDA device and is refused elsewhere.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import warnings
from typing import Any, Callable, Optional

import torch
from torch import fx

from autopar import _compat
from autopar.core.errors import OptionsError
from autopar.core.options import CUDA_GRAPHS_MODE


class CompileFallbackWarning(UserWarning):
    """Options.compile was asked for but the program runs eagerly."""


def inductor_unavailable(device: torch.device) -> Optional[str]:
    """Why Inductor cannot compile for `device` here, or None."""
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") else "Triton is not installed (pip install triton)"
    compilers = [c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c]
    if not any(shutil.which(c) for c in compilers):
        return "no C++ compiler found (tried $CXX, g++, c++, clang++); install one (apt-get install g++)"
    return None


def compiled_program(gm: fx.GraphModule, device: torch.device, options: Optional[dict] = None) -> Callable[..., Any]:
    """`gm` under torch.compile, or `gm` itself (with one warning) where that cannot work."""
    if (options or {}).get("mode") == CUDA_GRAPHS_MODE and device.type != "cuda":
        raise OptionsError(f"CUDA graphs (Options.cuda_graphs, torch.compile mode={CUDA_GRAPHS_MODE!r}) need the "
                           f"rank's tensors on a CUDA device; this rank runs on {device}: drop cuda_graphs, or "
                           "place the model on this rank's GPU")
    reason = inductor_unavailable(device)
    if reason is not None:
        warnings.warn(CompileFallbackWarning(f"Options.compile: running the rank program eagerly: {reason}"),
                      stacklevel=3)
        return gm
    return _FirstCallFallback(torch.compile(gm, **{"fullgraph": True, **(options or {})}), gm)


class _FirstCallFallback:
    """Compilation happens at the first call; if the backend fails there, warn once and
    run eagerly from then on. A graph break under fullgraph=True is a bug and is raised."""

    def __init__(self, compiled: Callable[..., Any], eager: fx.GraphModule) -> None:
        self.compiled, self.eager = compiled, eager
        self.run: Callable[..., Any] = self._first

    def __call__(self, *args: Any) -> Any:
        return self.run(*args)

    def _first(self, *args: Any) -> Any:
        try:
            out = self.compiled(*args)
        except _compat.backend_compiler_failed() as e:
            warnings.warn(CompileFallbackWarning(f"Options.compile: Inductor failed ({type(e.inner_exception).__name__}: "
                                                 f"{str(e.inner_exception)[:300]}); running the rank program eagerly"),
                          stacklevel=3)
            self.run = self.eager
            return self.eager(*args)
        self.run = self.compiled
        return out
