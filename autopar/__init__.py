"""autopar: automatic sharding of PyTorch models over a device mesh.

    pm = autopar.compile(model, mesh=(2, 4))      # under torchrun, 8 ranks
    plan = autopar.plan(model, args, mesh=(2, 4))  # offline
    autopar.evaluate(plan), autopar.hand_plan(model, args, mesh=(2, 4), style="fsdp")
    autopar.plan_report(plan, "plan.html")         # the plan as one self-contained HTML page

The public names load lazily (PEP 562 module __getattr__): `import autopar.passes.solve.solve`
loads the planner and nothing above it (no runtime, no torch.distributed process groups),
which tests/test_layers.py checks layer by layer.
"""

from __future__ import annotations

import importlib
from typing import Any

from autopar._version import __version__
from autopar.core.log import configure_from_env

configure_from_env()  # AUTOPAR_LOG=info: planning's stages on stderr (autopar/core/log.py)

# public name -> the module that defines it (layers: core -> cost_models -> passes -> runtime -> tools/api)
_EXPORTS = {
    "Mesh": "autopar.core.mesh", "Options": "autopar.core.options",
    "CostSource": "autopar.core.options", "Clustering": "autopar.core.options", "SolverChoice": "autopar.core.options",
    "PipelineAxis": "autopar.core.pipeline",
    "Dynamic": "autopar.core.dynamic", "OutOfRange": "autopar.core.dynamic",
    "Link": "autopar.core.links", "LinkKind": "autopar.core.links",
    "Spec": "autopar.core.placement", "TensorMeta": "autopar.core.placement", "Shard": "autopar.core.placement",
    "Replicate": "autopar.core.placement", "Partial": "autopar.core.placement",
    "Plan": "autopar.core.plan", "Collective": "autopar.core.plan", "PlanBook": "autopar.core.plan_book",
    "AutoparError": "autopar.core.errors", "TraceError": "autopar.core.errors",
    "UnsupportedModelError": "autopar.core.errors", "SolverError": "autopar.core.errors",
    "MeshError": "autopar.core.errors", "InputMismatchError": "autopar.core.errors",
    "ProcessGroupError": "autopar.core.errors", "MemoryBudgetError": "autopar.core.errors",
    "PlanFileError": "autopar.core.errors", "FingerprintMismatchError": "autopar.core.errors",
    "OptionsError": "autopar.core.errors", "HandPlanError": "autopar.core.errors", "PinError": "autopar.core.errors",
    "CollectiveError": "autopar.core.errors", "PlanningError": "autopar.core.errors",
    "evaluate": "autopar.cost_models.evaluate", "Evaluation": "autopar.cost_models.evaluate",
    "hand_plan": "autopar.passes.plan.hand_plans",
    "ParallelModule": "autopar.runtime.module",
    "Schedule": "autopar.core.pipeline", "PipelineError": "autopar.core.pipeline",
    "verify": "autopar.tools.verify", "VerifyReport": "autopar.tools.verify",
    "compile": "autopar.api", "plan": "autopar.api",
    "compile_for_generation": "autopar.api", "plan_for_generation": "autopar.api", "Generator": "autopar.runtime.generation",
    "CacheLimitError": "autopar.core.errors", "CacheReleasedError": "autopar.core.errors",
    "PlanChangedWarning": "autopar.runtime.resume",
    "WorldChangedWarning": "autopar.runtime.world_change", "ElasticSampler": "autopar.runtime.data",
    "save_training_checkpoint": "autopar.api", "load_training_checkpoint": "autopar.api", "resume": "autopar.api",
    "latest_checkpoint": "autopar.api", "CheckpointManifest": "autopar.api", "CheckpointError": "autopar.core.errors",
    "GradientError": "autopar.core.errors", "PipelineMemoryError": "autopar.core.pipeline",
    "AutoparTrainer": "autopar.tools.trainer", "TrainerError": "autopar.core.errors",
    "plan_report": "autopar.tools.report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    """The public names (and the module's own dunders), not what the loader imports."""
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
