"""Work a rank program need not repeat every step, removed after the rewrite (stage 7).

1. Export's metadata assertions (aten._assert_tensor_metadata): the trace has already
   checked the dtypes and devices they assert, and each costs a dispatch per step.
2. Attention masks that are causal by construction. torch.export records the mask a
   model builds for scaled_dot_product_attention (transformers materialises it while
   tracing, where eagerly it passes is_causal=True instead), so the program rebuilds it
   from aranges and comparisons on every step and attention runs its masked kernel. Where
   the mask depends on no program input (no parameter, buffer or user tensor: only
   constants the graph makes itself), it is evaluated once here; if it is exactly the
   lower-triangular mask torch's is_causal=True stands for (top-left aligned, every
   leading index alike), the call takes is_causal=True and the ops that built the mask go.

Same math, exactly: is_causal=True is defined as that mask. Anything else (a mask fed by
an input, a sliding window, padding, a row or column of size one whose extent broadcasting
would hide, an op that draws random numbers or allocates uninitialised memory) is left as
traced."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

aten = torch.ops.aten
_ASSERTS = (aten._assert_tensor_metadata.default,)
_SDPA = aten.scaled_dot_product_attention.default
_MASK_ARG, _CAUSAL_ARG = 3, 5  # sdpa(query, key, value, attn_mask, dropout_p, is_causal, *, scale, enable_gqa)
_UNFOLDABLE_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)


def fold(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` without export's assertions and with causal masks as is_causal=True (in place)."""
    graph = gm.graph
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target in _ASSERTS]:
        graph.erase_node(node)
    verdicts: dict[fx.Node, bool] = {}
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is _SDPA]:
        _causal_in_place_of_mask(graph, node, verdicts)
    graph.lint()
    gm.recompile()
    return gm


def _causal_in_place_of_mask(graph: fx.Graph, sdpa: fx.Node, verdicts: dict[fx.Node, bool]) -> None:
    mask = sdpa.args[_MASK_ARG] if len(sdpa.args) > _MASK_ARG else sdpa.kwargs.get("attn_mask")
    if not isinstance(mask, fx.Node) or _is_causal_arg(sdpa):
        return
    closure = _constant_closure(mask)
    if closure is None:
        return
    if mask not in verdicts:  # layers share one mask: evaluated once
        verdicts[mask] = _is_causal(_evaluate(closure)[mask])
    if not verdicts[mask]:
        return
    args = list(sdpa.args)
    if len(args) > _MASK_ARG:
        args[_MASK_ARG] = None
    kwargs = {k: v for k, v in sdpa.kwargs.items() if k != "attn_mask"}
    if len(args) > _CAUSAL_ARG:
        args[_CAUSAL_ARG] = True
    else:
        kwargs["is_causal"] = True
    sdpa.args, sdpa.kwargs = tuple(args), kwargs
    for node in reversed(closure):  # the ops that built the mask, once no other call uses them
        if not node.users:
            graph.erase_node(node)


def _is_causal_arg(sdpa: fx.Node) -> bool:
    return bool(sdpa.args[_CAUSAL_ARG] if len(sdpa.args) > _CAUSAL_ARG else sdpa.kwargs.get("is_causal", False))


def _constant_closure(root: fx.Node) -> Optional[list[fx.Node]]:
    """`root` and every node it depends on, in graph order, when none is a program input
    or an op whose value is not a pure function of its arguments; else None."""
    seen: dict[fx.Node, None] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if not _foldable(node):
            return None
        seen[node] = None
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _foldable(node: fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace != "aten" or target._schema.is_mutable or "empty" in target.__name__:
        return False
    return not any(tag in target.tags for tag in _UNFOLDABLE_TAGS)


def _evaluate(closure: list[fx.Node]) -> dict[fx.Node, Any]:
    """The closure's values, computed on the CPU (they depend on no input, and the
    device an op names changes where its value lives, not what it is)."""
    values: dict[fx.Node, Any] = {}
    on_cpu = lambda x: torch.device("cpu") if isinstance(x, torch.device) else x  # noqa: E731
    for node in closure:
        args = fx.node.map_aggregate(fx.node.map_arg(node.args, values.__getitem__), on_cpu)
        kwargs = fx.node.map_aggregate(fx.node.map_arg(node.kwargs, values.__getitem__), on_cpu)
        values[node] = node.target(*args, **kwargs)
    return values


def _is_causal(mask: Any) -> bool:
    """Whether `mask` is what sdpa's is_causal=True means for its query and key extents:
    ones(L, S).tril() (booleans), or 0 there and -inf elsewhere (an additive mask)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2 or min(mask.shape[-2:]) < 2:
        return False  # an extent of one broadcasts: the attention's own extent is unknown here
    allowed = torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return torch.equal(mask, allowed.expand_as(mask))
    if not mask.is_floating_point():
        return False
    expected = torch.zeros(mask.shape[-2:], dtype=mask.dtype).masked_fill(~allowed, float("-inf"))
    return torch.equal(mask, expected.expand_as(mask))
