"""Typed errors. Each message names the culprit (op, node, tensor, file) and the fix."""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class MeshError(AutoparError, ValueError):
    """The mesh shape is malformed or does not match the process group."""


class TraceError(AutoparError):
    """torch.export could not trace the model."""


class UnsupportedModelError(AutoparError):
    """The traced program does something autopar refuses to parallelise."""


class SolverError(AutoparError):
    """The ILP had no feasible or no optimal solution."""


class MemoryBudgetError(SolverError):
    """No plan fits the per-rank memory budget; carries the budget and the smallest footprint."""

    def __init__(self, budget: int, smallest: int) -> None:
        self.budget_bytes, self.smallest_bytes = budget, smallest
        super().__init__(f"no plan fits the memory budget of {budget} bytes ({budget / 2**20:.2f} MiB) per rank; "
                         f"the smallest footprint found is {smallest} bytes ({smallest / 2**20:.2f} MiB). Raise "
                         "Options.memory_budget_bytes, use a larger mesh, or plan for inference")


class InputMismatchError(AutoparError, ValueError):
    """Run-time inputs do not match the ones the program was planned for."""


class ProcessGroupError(AutoparError, RuntimeError):
    """torch.distributed is not initialised or does not fit the mesh."""


def describe_node(node) -> str:
    """'node add_3 (aten.add.Tensor) at model.py:41' using the source line export kept."""
    where = ""
    trace = node.meta.get("stack_trace") if hasattr(node, "meta") else None
    if trace:
        lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
        if lines:
            where = " at " + lines[-1].replace("File ", "").split(", in ")[0]
    target = getattr(node, "target", "?")
    return f"node {node.name} ({target}){where}"
