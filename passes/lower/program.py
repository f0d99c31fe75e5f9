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

    def experts(self, axis: int, ids: torch.Tensor, rows: list, experts: list, row_group: list,
                num_experts: int, body: str, where: str) -> torch.Tensor: ...

    def causal_rows(self, axis: int, unit: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    dropout_p: float, scale: Optional[float], enable_gqa: bool, where: str) -> torch.Tensor: ...


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


class ExpertsModule(nn.Module):
    """Routed experts split over mesh axis `axis` with their rows (expert parallelism,
    autopar/core/routed.py): `routed_experts = self.ap_experts_0(ids, [x, w], [w1, w2], [2, 1], 8, body)`
    sends each row to the rank of the axis that holds its expert and takes the result back."""

    def __init__(self, axis: int, where: str) -> None:
        super().__init__()
        self.axis = axis
        self.where = where  # the node, for error messages
        self.runner: Optional[StepRunner] = None

    def forward(self, ids: torch.Tensor, rows: list, experts: list, row_group: list, num_experts: int,
                body: str) -> torch.Tensor:
        return _runner(self).experts(self.axis, ids, rows, experts, row_group, num_experts, body, self.where)

    def extra_repr(self) -> str:
        return f"experts split over axis {self.axis}, node={self.where}"


class CausalRowsModule(nn.Module):
    """Causal self-attention with its rows split on mesh axis `axis`, balanced with the
    mirror rank of the axis (autopar/core/causal.py):
    `sdpa = self.ap_causal_sdpa(q, k, v, None, 0.0, True, scale=None, enable_gqa=False)`."""

    def __init__(self, axis: int, unit: int, where: str) -> None:
        super().__init__()
        self.axis, self.unit = axis, unit
        self.where = where  # the node, for error messages
        self.runner: Optional[StepRunner] = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = True, *,
                scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
        return _runner(self).causal_rows(self.axis, self.unit, query, key, value, dropout_p, scale, enable_gqa,
                                         self.where)

    def extra_repr(self) -> str:
        return f"causal rows balanced over axis {self.axis}, node={self.where}"


RUNNER_MODULES = (StepModule, WaitModule, ExpertsModule, CausalRowsModule)


def _runner(m: "StepModule | WaitModule | ExpertsModule | CausalRowsModule") -> StepRunner:
    if m.runner is None:
        what = f"{m.step} on the edge" if hasattr(m, "step") else \
            "expert parallelism at node" if isinstance(m, ExpertsModule) else "balanced causal attention at node"
        raise ProcessGroupError(f"{what} {m.where} has no process group: this program was "
                                "emitted for reading, not running; run a model through autopar.compile")
    return m.runner


def bind(gm: fx.GraphModule, runner: StepRunner) -> fx.GraphModule:
    """Give every reshard step of `gm` the runner that executes it; returns gm."""
    for m in gm.modules():
        if isinstance(m, RUNNER_MODULES):
            m.runner = runner
    return gm
