"""Work a rank program need not repeat every step, removed after the rewrite (stage 7).

Export's metadata assertions (aten._assert_tensor_metadata): the trace has already checked
the dtypes and devices they assert, and each costs a dispatch per step. (Masks that are
causal by construction are made is_causal=True earlier, in the trace:
passes/trace/causal_masks.py, so that the planner prices and splits them as causal.)"""

from __future__ import annotations

import torch
from torch import fx

_ASSERTS = (torch.ops.aten._assert_tensor_metadata.default,)


def fold(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` without export's assertions (in place)."""
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _ASSERTS]:
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm
