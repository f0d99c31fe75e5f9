"""Mean losses as a sum over a count, so their rows can be split over ranks.

    cross_entropy_loss(x, t, None, mean, ignore)  ->  cross_entropy_loss(x, t, None, sum, ignore)
                                                       / sum(t != ignore)

(and the same for nll_loss and nll_loss_nd). The mean aten computes is exactly that sum
over that count (0 / 0 where every target is ignored, as aten's). Split into two sums, a
loss over rows split across ranks is each rank's partial sum and partial count
(passes/rules/nn.py: a sum over split rows is Partial), reduced as two scalars; the mean
itself would have to run replicated, its input gathered whole first. For a causal LM that
input is the logits, batch x sequence x vocabulary: at 32768 tokens and Llama 3's
128256 words, 16 GiB of float32 per rank for one gather.

Left as it is: class weights (the mean divides by the targets' weights), label smoothing,
probability targets (floating point: the mean divides by the batch), an input of one
dimension (a single sample), any reduction but the mean, and inputs below float32 (aten
divides its float32 sum and rounds once; the sum rounded to bfloat16 first would round
twice). transformers' causal-LM loss upcasts the logits to float32 first.
"""

from __future__ import annotations

import torch
from torch import fx

from autopar.core.kinds import LossReduction
from autopar.passes.trace.functionalize import new_node

aten = torch.ops.aten

_MEAN_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default}
# (input, target, weight, reduction, ignore_index[, label_smoothing]): the schema's defaults
_DEFAULTS = (None, None, None, int(LossReduction.MEAN), -100, 0.0)
_NAMES = ("self", "target", "weight", "reduction", "ignore_index", "label_smoothing")


def mean_losses_as_sums(gm: fx.GraphModule) -> int:
    """Rewrite every mean loss of `gm` this module covers; returns how many. Does not
    recompile `gm`."""
    changed = 0
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _MEAN_LOSSES]:
        args = _arguments(node)
        if not _splittable(args):
            continue
        x, target, _, _, ignore, *smoothing = args
        with gm.graph.inserting_before(node):  # named as torch.export names these ops
            total = new_node(gm, node, node.target, (x, target, None, int(LossReduction.SUM), ignore, *smoothing), {},
                             node.target.__name__.split(".")[0])
            valid = new_node(gm, node, aten.ne.Scalar, (target, ignore), {}, "ne")
            count = new_node(gm, node, aten.sum.default, (valid,), {}, "sum")
            mean = new_node(gm, node, aten.div.Tensor, (total, count), {}, "div")
        node.replace_all_uses_with(mean)
        gm.graph.erase_node(node)
        changed += 1
    return changed


def _arguments(node: fx.Node) -> list:
    """The call's arguments in schema order, defaults filled in (label smoothing only for
    cross_entropy_loss)."""
    count = 6 if node.target is aten.cross_entropy_loss.default else 5
    args = list(node.args) + [node.kwargs.get(name, _DEFAULTS[i]) for i, name in enumerate(_NAMES)][len(node.args):]
    return args[:count]


def _splittable(args: list) -> bool:
    x, target, weight, reduction, _ignore, *smoothing = args
    if reduction != LossReduction.MEAN or weight is not None or any(s != 0.0 for s in smoothing):
        return False
    xv, tv = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (x, target))
    if not isinstance(xv, torch.Tensor) or not isinstance(tv, torch.Tensor):
        return False
    return xv.ndim >= 2 and xv.dtype in (torch.float32, torch.float64) and not tv.is_floating_point()
