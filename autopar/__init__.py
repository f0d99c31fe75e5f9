"""autopar: automatic sharding of PyTorch models over a device mesh.

    pm = autopar.compile(model, mesh=(2, 4))      # under torchrun, 8 ranks
    plan = autopar.plan(model, args, mesh=(2, 4))  # offline
    autopar.evaluate(plan), autopar.hand_plan(model, args, mesh=(2, 4), style="fsdp")
"""

from autopar.errors import (AutoparError, InputMismatchError, MemoryBudgetError, MeshError, ProcessGroupError, SolverError,
                            TraceError, UnsupportedModelError)
from autopar.mesh import Mesh
from autopar.options import Options
from autopar.placement import Partial, Replicate, Shard, Spec, TensorMeta
from autopar.plan import Collective, Plan
from autopar.api import compile, plan
from autopar.runtime import ParallelModule
from autopar.verify import VerifyReport, verify
from autopar.evaluate import Evaluation, evaluate
from autopar.hand_plans import hand_plan

__version__ = "0.1.0"

__all__ = [
    "compile", "plan", "Plan", "Options", "ParallelModule", "Mesh", "Spec", "TensorMeta", "Shard", "Replicate",
    "Partial", "Collective", "AutoparError", "TraceError", "UnsupportedModelError", "SolverError", "MeshError",
    "InputMismatchError", "ProcessGroupError", "MemoryBudgetError", "verify", "VerifyReport",
    "evaluate", "Evaluation", "hand_plan",
]
