"""Per-op sharding rules. Importing this package registers every family."""

from autopar.passes.rules import matmul, misc, moe, nn, pointwise, reductions, views, vision  # noqa: F401
from autopar.passes.rules.registry import (AxisRule, OpCall, Strategy, TensorArg, expand, register,
                                           registered_targets, replicate_rule, rule_for)

__all__ = ["AxisRule", "OpCall", "Strategy", "TensorArg", "expand", "register", "registered_targets",
           "replicate_rule", "rule_for"]
