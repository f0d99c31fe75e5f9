"""In-place writes made functional, so every rank can plan and run them (trace's step 3).

    before:  add_ = add_(b_bn_num_batches_tracked, 1)
             batch_norm = batch_norm(x, w, b, b_bn_running_mean, b_bn_running_var, True, 0.1, 1e-05)
    after:   add = add(b_bn_num_batches_tracked, 1)                       # an output updates the buffer
             mean = mean(x, [0, 2, 3], True); centred = sub(x, mean)     # statistics over the batch
             var = mean(mul(centred, centred), [0, 2, 3], True) ...      # ... in ops with sharding rules
             return (new_running_mean, new_running_var, add, ..., user outputs)

1. needs_functionalising: an op writes an intermediate value or a buffer in place, or a
   training batch_norm writes its running statistics (a write its schema does not show).
   torch.export's run_decompositions then turns each write into a value, and each write
   to a buffer into an extra graph output (a BUFFER_MUTATION output spec).
2. differentiable_copies: the `aten.copy` a slice write leaves has no derivative; spell
   it in differentiable ops.
3. sync_batch_norms: a training `_native_batch_norm_legit_functional` becomes the ops of
   its definition (mean, centred square mean, rsqrt, affine, running-statistics update).
   Each has a sharding rule, so a batch split of the input reduces to partial means that
   the plan all-reduces over the batch axis: SyncBatchNorm's statistics of the whole
   batch (two passes, mean then centred variance, which is how one device computes
   them), priced by the planner like any other collective.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

aten = torch.ops.aten

# their schemas carry no (a!) for the running statistics they update in training
HIDDEN_STATE_WRITES = {aten.batch_norm.default: (5, (3, 4))}  # training arg, running-stat args
LOW_PRECISION = (torch.float16, torch.bfloat16)  # statistics computed in fp32, as torch does


def written_args(node: fx.Node) -> list[fx.Node]:
    """Graph values an op writes in place, read from its schema's (a!) annotations."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if isinstance(value, fx.Node):
            out.append(value)
    return out


def needs_functionalising(gm: fx.GraphModule, buffers: set[str]) -> bool:
    """Step 1: whether `gm` writes an intermediate value or one of the placeholders named
    in `buffers` in place. Writes to parameters and inputs are left as they are, for
    trace to refuse with the op that writes them."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if any(w.op != "placeholder" or w.name in buffers for w in written_args(node)):
            return True
        hidden = HIDDEN_STATE_WRITES.get(node.target)
        if hidden is not None and _arg(node, hidden[0]) and any(
                isinstance(_arg(node, i), fx.Node) for i in hidden[1]):
            return True
    return False


def _arg(node: fx.Node, i: int) -> Any:
    return node.args[i] if i < len(node.args) else None


def differentiable_copies(gm: fx.GraphModule) -> None:
    """Step 2: functionalisation turns `dst[...] = src` into `slice_scatter(x, copy(dst, src))`;
    `aten.copy` has no derivative, so training such a model fails in backward. Its value is
    `src` cast to dst's dtype and broadcast to dst's shape, which these ops say with
    derivatives (and rules): `clone(expand(_to_copy(src)))`, each step only where needed.
    The code is regenerated only where something changed (a second a pass on 10^4 nodes)."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.copy.default:
            continue
        changed = True
        dst, src = node.args[0], node.args[1]
        dst_val, value = dst.meta["val"], src.meta["val"]
        with gm.graph.inserting_before(node):
            if value.dtype != dst_val.dtype:
                src = new_node(gm, node, aten._to_copy.default, (src,), {"dtype": dst_val.dtype})
                value = src.meta["val"]
            if tuple(value.shape) != tuple(dst_val.shape):
                src = new_node(gm, node, aten.expand.default, (src, list(dst_val.shape)), {})
            out = new_node(gm, node, aten.clone.default, (src,), {})
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
    if changed:
        gm.recompile()


def new_node(gm: fx.GraphModule, like: fx.Node, target: Any, args: tuple, kwargs: dict,
             name: Optional[str] = None) -> fx.Node:
    """A call inserted in place of `like`, with its value computed on the fake inputs and
    `like`'s source location (errors and the plan name the user's line); named `name`
    (numbered where taken), else as FX names the target."""
    node = gm.graph.call_function(target, args, kwargs, name=name)
    vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    node.meta = {k: v for k, v in like.meta.items() if k != "val"}
    node.meta["val"] = target(*vals[0], **vals[1])
    return node


# training batch norms after functionalisation -> (x, weight, bias, running_mean,
# running_var, momentum, eps) of their arguments; outputs (out, save_mean, save_invstd,
# then the new running mean and variance where the op keeps them)
TRAINING_BATCH_NORMS = {
    aten._native_batch_norm_legit_functional.default: lambda a: (a[5], a[:5] + a[6:8]),
    aten._native_batch_norm_legit.no_stats: lambda a: (a[3], a[:3] + (None, None) + a[4:6]),
}


def sync_batch_norms(gm: fx.GraphModule) -> None:
    """Step 3: every training batch norm left by functionalisation replaced by the ops
    that define it (the code regenerated only where one was)."""
    changed = False
    for node in list(gm.graph.nodes):
        unpack = TRAINING_BATCH_NORMS.get(node.target) if node.op == "call_function" else None
        if unpack is None:
            continue
        training, args = unpack(tuple(node.args))
        if not training:
            continue
        changed = True
        with gm.graph.inserting_before(node):
            results = _batch_norm_ops(gm, node, *args)
        for user in list(node.users):  # getitem(node, k)
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    if changed:
        gm.recompile()


def _batch_norm_ops(gm: fx.GraphModule, node: fx.Node, x: fx.Node, weight: Any, bias: Any, running_mean: Any,
                    running_var: Any, momentum: float, eps: float) -> tuple[fx.Node, ...]:
    """The definition torch's own decomposition (native_batch_norm_helper) spells:
    mean and biased variance over every dim but the channels; output
    (x - mean) * rsqrt(var + eps) * weight + bias; running mean and (unbiased) variance
    moved by `momentum` towards this batch's."""
    val = x.meta["val"]
    channels = val.shape[1]
    dims = [0, *range(2, val.ndim)]
    n = val.numel() // channels
    bcast = [1, channels] + [1] * (val.ndim - 2)

    def op(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        return new_node(gm, node, target, args, kwargs)

    acc = op(aten._to_copy.default, x, dtype=torch.float32) if val.dtype in LOW_PRECISION else x
    mean = op(aten.mean.dim, acc, dims, True)
    centred = op(aten.sub.Tensor, acc, mean)
    var = op(aten.mean.dim, op(aten.mul.Tensor, centred, centred), dims, True)
    invstd = op(aten.rsqrt.default, op(aten.add.Tensor, var, eps))
    out = op(aten.mul.Tensor, centred, invstd)
    if weight is not None:
        out = op(aten.mul.Tensor, out, op(aten.view.default, weight, bcast))
    if bias is not None:
        out = op(aten.add.Tensor, out, op(aten.view.default, bias, bcast))
    if out.meta["val"].dtype != val.dtype:
        out = op(aten._to_copy.default, out, dtype=val.dtype)
    save_mean = op(aten.view.default, mean, [channels])
    save_invstd = op(aten.view.default, invstd, [channels])
    if running_mean is None:
        return out, save_mean, save_invstd
    unbiased = op(aten.mul.Tensor, op(aten.view.default, var, [channels]), n / (n - 1))
    return (out, save_mean, save_invstd, _moved(op, running_mean, save_mean, momentum),
            _moved(op, running_var, unbiased, momentum))


def _moved(op: Any, running: fx.Node, batch: fx.Node, momentum: float) -> fx.Node:
    """momentum * batch + (1 - momentum) * running, in the running statistic's dtype."""
    new = op(aten.add.Tensor, op(aten.mul.Tensor, batch, momentum), op(aten.mul.Tensor, running, 1 - momentum))
    if new.meta["val"].dtype != running.meta["val"].dtype:
        new = op(aten._to_copy.default, new, dtype=running.meta["val"].dtype)
    return new
