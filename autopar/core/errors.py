"""Typed errors, all of them here: one type per failure, whichever stage finds it.

Each message names the culprit (op, node with its source line, tensor, file) and the fix.
Every type pickles with its fields, so an error raised while rank 0 plans reaches the
other ranks as the same type (autopar/runtime/agree.py).
"""

from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class OptionsError(AutoparError, ValueError):
    """An Options field holds a value autopar cannot use (named with the fix)."""


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

    def __init__(self, budget: int, smallest: int, origin: str = "") -> None:
        self.budget_bytes, self.smallest_bytes, self.origin = budget, smallest, origin
        where = f" (the default {origin})" if origin else ""
        super().__init__(f"no plan fits the memory budget of {budget} bytes ({budget / 2**20:.2f} MiB) per rank"
                         f"{where}; the smallest footprint found is {smallest} bytes ({smallest / 2**20:.2f} MiB). "
                         "Raise Options.memory_budget_bytes or use a larger mesh (more ranks to split over)")

    def __reduce__(self):
        return (type(self), (self.budget_bytes, self.smallest_bytes, self.origin))


class HandPlanError(AutoparError, ValueError):
    """A hand-plan style that does not apply to this model, input or mesh."""


class PinError(AutoparError, ValueError):
    """A pinned op layout (a hand plan's attention) that none of the op's strategies has."""


class PlanFileError(AutoparError, ValueError):
    """A plan or profile file is missing, unreadable, damaged or of another schema version."""


class FingerprintMismatchError(AutoparError, ValueError):
    """A plan is applied to a graph other than the one it was made for (another model,
    other input shapes, or a rank that traced differently). Carries both fingerprints."""

    def __init__(self, message: str, expected: str = "", found: str = "") -> None:
        self.expected, self.found = expected, found
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.expected, self.found))


class CollectiveError(AutoparError, RuntimeError):
    """A collective of a rank program failed or timed out (a peer rank probably died first)."""


class PlanningError(AutoparError, RuntimeError):
    """Planning failed on another rank with an error that could not be sent as itself;
    the message holds its type and text."""


class InputMismatchError(AutoparError, ValueError):
    """Run-time inputs do not match the ones the program was planned for."""


class CacheLimitError(InputMismatchError):
    """A generation request the static KV cache was not built for (too many rows, too
    long a prompt or too many positions); names the dim and the limit."""


class CacheReleasedError(AutoparError, RuntimeError):
    """A CachedLM whose full cache was handed to a ParallelModule (release_cache) was run."""


class ProcessGroupError(AutoparError, RuntimeError):
    """torch.distributed is not initialised or does not fit the mesh."""


class GradientError(AutoparError, RuntimeError):
    """Gradients asked for in a way autopar's reductions cannot serve (torch.autograd.grad
    on parameters whose data-parallel gradients are reduced into .grad)."""


class CheckpointError(AutoparError, RuntimeError):
    """A training checkpoint is incomplete, damaged, made for another model or optimiser
    (or, pipelined, another world), or could not be written; names the directory and what
    to do. Carries the path."""

    def __init__(self, message: str, path: str = "") -> None:
        self.path = path
        super().__init__(message)

    def __reduce__(self):
        return (type(self), (str(self), self.path))


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


class TrainerError(AutoparError, ValueError):
    """A transformers Trainer set up in a way a ParallelModule cannot train under (a
    TrainingArguments field autopar replaces, a pipelined plan, another device); names
    the field and the fix."""
