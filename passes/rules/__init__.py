"""Stage 2: per-op sharding rules, the local form of each op (local.py) and running an op block by block
(blockwise.py). Importing this package registers every family."""

from autopar.passes.rules import matmul, misc, moe, nn, pointwise, reductions, views, vision  # noqa: F401
from autopar.passes.rules.registry import (AxisRule, OpCall, Strategy, TensorArg, expand, register,
                                           registered_targets, replicate_rule, rule_for)

__all__ = ["AxisRule", "OpCall", "Strategy", "TensorArg", "expand", "register", "registered_targets",
           "replicate_rule", "rule_for"]
