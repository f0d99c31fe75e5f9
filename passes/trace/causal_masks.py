"""Explicit causal masks made causal: an sdpa whose attn_mask is computed from no graph
input and is provably the causal triangle (row i sees keys 0..i: booleans, or an additive
mask of 0 and -inf) becomes sdpa(..., attn_mask=None, is_causal=True), and the ops that
built the mask go. Same math, exactly: is_causal=True is defined as that mask.

transformers builds its causal mask as ops when traced (masking_utils: under torch.export
it never skips the mask for sdpa's is_causal): aranges of positions, packed-sequence ids
from their differences, and `kv_pos[j] <= q_pos[i] & seq_id[i] == seq_id[j]` broadcast to
[B, 1, L, S]. Run eagerly without padding the same model calls is_causal. As is_causal,
the attention's cost is the triangle's (cost_models/attention.py) and its rows split
along the sequence run balanced (autopar/core/causal.py).

The proof evaluates the mask's ops on the CPU, never the [B, 1, L, S] tensor itself where
it is big: a value of at most SMALL elements, or one of size 1 along the queries or the
keys, is computed whole; a bigger boolean must be
made by comparing a row vector (size 1 along keys) with a column vector (size 1 along
queries) whose values never decrease along the keys, so each row's true keys are one
interval [lo, hi), and by and-ing, casting to bool and expanding such values. The mask is
the triangle when every row's interval is [0, i + 1). Anything else (a mask read from an
input or a buffer, a sliding window, padding, an op that draws random numbers or allocates
uninitialised memory, a big additive mask, an op outside these) leaves the sdpa as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Union

import torch
from torch import fx

from autopar.core.causal import sdpa_is_causal

aten = torch.ops.aten

SMALL = 1 << 22  # elements of a value computed whole
SDPA = aten.scaled_dot_product_attention.default
_MASK_ARG, _CAUSAL_ARG = 3, 5  # sdpa(query, key, value, attn_mask, dropout_p, is_causal, *, scale, enable_gqa)
_UNFOLDABLE_TAGS = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)
_COMPARE = {aten.le.Tensor: "le", aten.lt.Tensor: "lt", aten.ge.Tensor: "ge", aten.gt.Tensor: "gt",
            aten.eq.Tensor: "eq"}
_AND = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}
_CAST = {aten.to.dtype_layout, aten.to.dtype, aten._to_copy.default, aten.clone.default, aten.alias.default}
_CHECK = aten._assert_tensor_metadata.default
# a comparison read the other way round (row op column as column op' row)
_FLIPPED = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq"}


class _NotProven(Exception):
    """The mask is not shown to be the triangle (which is no error: the sdpa stays)."""


@dataclass(frozen=True)
class _Rows:
    """A boolean [..., L, S] value whose true keys in each row form [lo, hi): lo and hi
    broadcast to its leading dims and L."""

    lo: torch.Tensor
    hi: torch.Tensor


_Form = Union[torch.Tensor, _Rows]


def causal_masks_to_is_causal(gm: fx.GraphModule) -> int:
    """Rewrite every sdpa of `gm` whose mask is proven causal (module docstring); returns
    how many. Does not recompile `gm`."""
    changed = 0
    verdicts: dict[tuple, bool] = {}  # layers share one mask: proven once per query and key extent
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]:
        mask = node.args[_MASK_ARG] if len(node.args) > _MASK_ARG else node.kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node) or sdpa_is_causal(node.args, node.kwargs):
            continue
        query, key = (node.args[i].meta.get("val") for i in (0, 1))
        extents = tuple(t.shape[-2] if isinstance(t, torch.Tensor) and isinstance(t.shape[-2], int) else None
                        for t in (query, key))  # None: symbolic (such a mask is not proven)
        if (mask.name, extents) not in verdicts:
            verdicts[mask.name, extents] = _is_triangle(mask, query, key)
        if verdicts[mask.name, extents]:
            _call_causal(node)
            _drop_unused(gm.graph, mask)
            changed += 1
    return changed


def _call_causal(sdpa: fx.Node) -> None:
    """sdpa(q, k, v, mask, ...) -> sdpa(q, k, v, None, ..., is_causal=True)."""
    args = list(sdpa.args)
    if len(args) > _MASK_ARG:
        args[_MASK_ARG] = None
    kwargs = {k: v for k, v in sdpa.kwargs.items() if k != "attn_mask"}
    if len(args) > _CAUSAL_ARG:
        args[_CAUSAL_ARG] = True
    else:
        kwargs["is_causal"] = True
    sdpa.args, sdpa.kwargs = tuple(args), kwargs


def _is_triangle(mask: fx.Node, query: Any, key: Any) -> bool:
    val = mask.meta.get("val")
    if not all(isinstance(t, torch.Tensor) for t in (val, query, key)):
        return False
    if not all(isinstance(n, int) for n in (*val.shape, *query.shape, *key.shape)):
        return False  # symbolic sizes: the mask's ops depend on the call
    if val.ndim < 2 or tuple(val.shape[-2:]) != (query.shape[-2], key.shape[-2]):
        return False  # a mask that broadcasts along the queries or keys hides their extent
    try:
        form = _Evaluator().form(mask)
    except _NotProven:
        return False
    if isinstance(form, torch.Tensor):
        return is_triangle(form)
    positions = torch.arange(query.shape[-2])
    return bool((form.lo == 0).all()) and bool((form.hi == (positions + 1).clamp(max=key.shape[-2])).all())


def is_triangle(mask: torch.Tensor) -> bool:
    """Whether `mask` is what sdpa's is_causal=True means for its query and key extents:
    ones(L, S).tril() (booleans), or 0 there and -inf elsewhere (an additive mask)."""
    if mask.dim() < 2:
        return False
    allowed = torch.ones(mask.shape[-2:], dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return torch.equal(mask, allowed.expand_as(mask))
    if not mask.is_floating_point():
        return False
    expected = torch.zeros(mask.shape[-2:], dtype=mask.dtype).masked_fill(~allowed, float("-inf"))
    return torch.equal(mask, expected.expand_as(mask))


class _Evaluator:
    def __init__(self) -> None:
        self.done: dict[str, _Form] = {}

    def form(self, node: fx.Node) -> _Form:
        if node.name not in self.done:
            self.done[node.name] = self._form(node)
        return self.done[node.name]

    def _form(self, node: fx.Node) -> _Form:
        if not _foldable(node):
            raise _NotProven(node.name)  # an input, a buffer, a constant, a random op or uninitialised memory
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise _NotProven(node.name)
        args = fx.node.map_arg(node.args, self.form)
        kwargs = fx.node.map_arg(node.kwargs, self.form)
        if _whole(val) and not _any_rows((args, kwargs)):
            try:
                return node.target(*_on_cpu(args), **_on_cpu(kwargs))
            except NotImplementedError as e:  # no CPU kernel for it: its value is not known here
                raise _NotProven(node.name) from e
        return _big(node, val, args)


def _foldable(node: fx.Node) -> bool:
    """An aten op whose value is a pure function of its arguments."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if target.namespace != "aten" or target._schema.is_mutable or "empty" in target.__name__:
        return False
    return not any(tag in target.tags for tag in _UNFOLDABLE_TAGS)


def _whole(val: torch.Tensor) -> bool:
    """Computed whole: small, or of size 1 along the queries or the keys (a position vector)."""
    return prod(val.shape) <= SMALL or (val.ndim >= 2 and min(val.shape[-2:]) == 1)


def _big(node: fx.Node, val: torch.Tensor, args: tuple) -> _Rows:
    if val.dtype is not torch.bool or val.ndim < 2:
        raise _NotProven(node.name)
    if node.target in _COMPARE and all(isinstance(a, torch.Tensor) for a in args[:2]):
        return _compared(_COMPARE[node.target], args[0], args[1], val, node.name)
    if node.target in _AND:
        return _anded(args[0], args[1], node.name)
    if node.target in _CAST and isinstance(args[0], _Rows):
        return args[0]
    if node.target is aten.expand.default and isinstance(args[0], _Rows):
        return args[0]  # lo and hi broadcast to the leading dims
    raise _NotProven(node.name)


def _compared(op: str, a: torch.Tensor, b: torch.Tensor, val: torch.Tensor, where: str) -> _Rows:
    """a `op` b where one is a row vector (size 1 along keys) and the other a column
    vector (size 1 along queries) that never decreases along the keys."""
    a, b = (x.reshape((1,) * (val.ndim - x.ndim) + tuple(x.shape)) for x in (a, b))
    if a.shape[-1] == 1 and b.shape[-2] == 1:  # row op column: as column flipped-op row
        a, b, op = b, a, _FLIPPED[op]
    if a.shape[-2] != 1 or b.shape[-1] != 1 or a.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise _NotProven(where)  # not a column against a row, or positions no binary search orders
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    column = a.expand(lead + (1, val.shape[-1])).reshape(-1, val.shape[-1])
    row = b.expand(lead + (val.shape[-2], 1)).reshape(-1, val.shape[-2])
    if column.shape[-1] > 1 and not bool((column[:, 1:] >= column[:, :-1]).all()):
        raise _NotProven(where)  # not sorted along the keys (NaN included): the true keys need not be one interval
    left = torch.searchsorted(column.contiguous(), row.contiguous(), right=False)
    right = torch.searchsorted(column.contiguous(), row.contiguous(), right=True)
    end = torch.full_like(left, val.shape[-1])
    # keys j with column[j] `op` row[i]
    zero = torch.zeros_like(left)
    lo, hi = {"le": (zero, right), "lt": (zero, left), "ge": (left, end), "gt": (right, end),
              "eq": (left, right)}[op]
    shape = lead + (val.shape[-2],)
    return _Rows(lo.reshape(shape), hi.reshape(shape))


def _anded(a: _Form, b: _Form, where: str) -> _Rows:
    if isinstance(a, torch.Tensor):
        a, b = b, a
    if isinstance(b, torch.Tensor):  # with a constant: all true keeps the rows, anything else is unproven
        if isinstance(a, _Rows) and b.dtype is torch.bool and bool(b.all()):
            return a
        raise _NotProven(where)
    return _Rows(torch.maximum(a.lo, b.lo), torch.minimum(a.hi, b.hi))


def _any_rows(tree: Any) -> bool:
    found = []
    fx.node.map_aggregate(tree, lambda x: found.append(isinstance(x, _Rows)))
    return any(found)


def _on_cpu(tree: Any) -> Any:
    """Factory arguments on the CPU (a graph traced on the meta device makes its aranges there)."""
    return fx.node.map_aggregate(tree, lambda x: torch.device("cpu") if isinstance(x, torch.device) else x)


def _drop_unused(graph: fx.Graph, start: fx.Node) -> None:
    """Erase `start` and the ops before it that nothing else reads any more."""
    todo, erased = [start], set()
    while todo:
        node = todo.pop()
        if node.op != "call_function" or node.name in erased:
            continue
        checks = [u for u in node.users if u.target is _CHECK and not u.users]
        if len(checks) != len(node.users):
            continue
        for check in checks:  # export's dtype/device checks of a .to(): nothing left to check
            graph.erase_node(check)
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node.name)
        todo.extend(inputs)
