"""The reshard steps inside an emitted rank program, before and after binding.

The rewrite (stage 5) puts one StepModule per reshard step into the program:

    ap_all_reduce_0 = self.ap_all_reduce_0(addmm_1)      # Step(all_reduce, axis=1)

A StepModule knows its Step and the edge it sits on, not how to communicate: the
planner never touches torch.distributed. Whoever runs the program binds a StepRunner
to every step first: the runtime binds one over its process groups
(autopar/runtime/collectives.py), the lockstep simulator (passes/simulate_mesh.py)
runs the steps itself. A program that was never bound (emitted to be read, e.g.
`python -m autopar code`) says so when called.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import fx, nn

from autopar.core.errors import ProcessGroupError
from autopar.core.resharding import Step

# (step, this rank's local tensor, "producer -> consumer") -> the tensor after the step
StepRunner = Callable[[Step, torch.Tensor, str], torch.Tensor]


class StepModule(nn.Module):
    """One reshard step in an emitted program: `ap_all_gather_3 = self.ap_all_gather_3(x)`."""

    def __init__(self, step: Step, where: str) -> None:
        super().__init__()
        self.step = step
        self.where = where  # "producer -> consumer", for error messages
        self.runner: Optional[StepRunner] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.runner is None:
            raise ProcessGroupError(f"{self.step} on the edge {self.where} has no process group: this program was "
                                    "emitted for reading, not running; run a model through autopar.compile")
        return self.runner(self.step, x, self.where)

    def extra_repr(self) -> str:
        return f"{self.step}, backward={self.step.backward}, edge={self.where}"


def step_modules(gm: fx.GraphModule) -> list[StepModule]:
    return [m for m in gm.modules() if isinstance(m, StepModule)]


def bind(gm: fx.GraphModule, runner: StepRunner) -> fx.GraphModule:
    """Give every reshard step of `gm` the runner that executes it; returns gm."""
    for m in step_modules(gm):
        m.runner = runner
    return gm
