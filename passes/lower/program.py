"""The reshard steps inside an emitted rank program, before and after binding.

The rewrite (stage 5) puts a StepModule per reshard step into the program, and after
each communicating one a WaitModule:

    ap_all_reduce_0 = self.ap_all_reduce_0(addmm_1)                  # start: issue the collective
    ...                                                              # independent compute
    ap_all_reduce_0_wait = self.ap_all_reduce_0_wait(ap_all_reduce_0)  # wait: its result

The schedule pass (passes/lower/schedule.py) moves starts early and waits late. The modules
know their Step and the edge they sit on, not how to communicate: the planner never
touches torch.distributed. Whoever runs the program binds a StepRunner first: the
runtime binds one over its process groups (autopar/runtime/step_runner.py), the
lockstep simulator (passes/lower/simulate_mesh.py) runs the steps itself. A program that was
never bound (emitted to be read, e.g. `python -m autopar code`) says so when called.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import fx, nn

from autopar.core.errors import ProcessGroupError
from autopar.core.resharding import Step


class StepRunner(Protocol):
    """Executes reshard steps on this rank's tensors. `start` may return a handle that
    only `wait` turns into the tensor (a collective in flight), or the tensor itself."""

    def start(self, step: Step, x: torch.Tensor, where: str) -> Any: ...

    def wait(self, step: Step, started: Any, where: str) -> torch.Tensor: ...


class StepModule(nn.Module):
    """One reshard step in an emitted program: `ap_all_gather_3 = self.ap_all_gather_3(x)`."""

    def __init__(self, step: Step, where: str) -> None:
        super().__init__()
        self.step = step
        self.where = where  # "producer -> consumer", for error messages
        self.runner: Optional[StepRunner] = None

    def forward(self, x: torch.Tensor) -> Any:
        return _runner(self).start(self.step, x, self.where)

    def extra_repr(self) -> str:
        return f"{self.step}, backward={self.step.backward}, edge={self.where}"


class WaitModule(nn.Module):
    """The end of a communicating step: `ap_all_gather_3_wait = self.ap_all_gather_3_wait(ap_all_gather_3)`."""

    def __init__(self, step: Step, where: str) -> None:
        super().__init__()
        self.step = step
        self.where = where
        self.runner: Optional[StepRunner] = None

    def forward(self, started: Any) -> torch.Tensor:
        return _runner(self).wait(self.step, started, self.where)

    def extra_repr(self) -> str:
        return f"wait for {self.step}, edge={self.where}"


def _runner(m: "StepModule | WaitModule") -> StepRunner:
    if m.runner is None:
        raise ProcessGroupError(f"{m.step} on the edge {m.where} has no process group: this program was "
                                "emitted for reading, not running; run a model through autopar.compile")
    return m.runner


def bind(gm: fx.GraphModule, runner: StepRunner) -> fx.GraphModule:
    """Give every reshard step of `gm` the runner that executes it; returns gm."""
    for m in gm.modules():
        if isinstance(m, (StepModule, WaitModule)):
            m.runner = runner
    return gm
