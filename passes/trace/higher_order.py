"""Higher-order ops that torch.export leaves in a graph, spelled in plain ATen ops so that
the rules, the rewrite and the runtime see one flat graph.

A `with torch.no_grad():` region inside a model's forward exports as

    out = wrap_with_set_grad_enabled(False, submod_k, *inputs)   # submod_k: a get_attr
    a, b = out[0], out[1]

and nothing downstream can shard or rewrite a call into a nested graph module. Inlining
the body after detaching its inputs computes the same values and lets no gradient
through, which is what the region means: its outputs do not require grad, and no
activation of it is saved for backward. One exception: a region's result that eager hands
back as its input itself (`h.float()` of a float: torch.export then gives the cast to
`h`'s readers after the region) is that input, gradient and all, not its detached copy."""

from __future__ import annotations

import operator

import torch
from torch import fx

from autopar.core.errors import UnsupportedModelError, describe_node
from autopar.passes.trace.functionalize import new_node, written_args

_GRAD_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled
# ops that return their input itself where they change nothing (`x.to(x.dtype)`)
_MAYBE_ITSELF = (torch.ops.aten.to, torch.ops.aten.contiguous, torch.ops.aten.type_as)


def inline_grad_regions(gm: fx.GraphModule) -> None:
    """Inline every `wrap_with_set_grad_enabled` call (nested ones too: an inlined body may
    bring its own). An enabled region (True) inlines as it is: the graph runs with
    gradients on wherever it is differentiated."""
    if not any(n.op == "call_function" and n.target is _GRAD_REGION for n in gm.graph.nodes):
        return
    while True:
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _GRAD_REGION]
        if not calls:
            break
        for call in calls:
            _inline(gm, call)
    gm.graph.eliminate_dead_code()
    for name, _ in list(gm.named_children()):
        if not any(n.op == "get_attr" and n.target == name for n in gm.graph.nodes):
            delattr(gm, name)
    gm.recompile()


def _inline(gm: fx.GraphModule, call: fx.Node) -> None:
    enabled, body_ref, *inputs = call.args
    body = getattr(gm, body_ref.target)
    if not isinstance(body, fx.GraphModule):
        raise UnsupportedModelError(f"{describe_node(call)}: a grad-mode region whose body is not a graph "
                                    f"({type(body).__name__}); autopar cannot inline it")
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    # a value the region writes in place is passed as itself: the write must reach it (and
    # a write to a parameter or a buffer be seen by trace's checks), not a detached alias
    written = {w for n in body.graph.nodes if n.op == "call_function" for w in written_args(n)}
    with gm.graph.inserting_before(call):
        for ph, value in zip(placeholders, inputs):
            keep = enabled or not _is_tensor(value) or ph in written
            env[ph] = value if keep else new_node(gm, value, torch.ops.aten.detach.default, (value,), {})
        for node in body.graph.nodes:
            if node.op == "get_attr":  # a nested region's body: lift it onto gm under a fresh name
                env[node] = _lifted(gm, body, node)
            elif node.op not in ("placeholder", "output"):
                env[node] = gm.graph.node_copy(node, lambda n: env[n])
    outer = dict(zip(placeholders, inputs))
    outputs = fx.node.map_arg(body.graph.output_node().args[0], lambda n: outer.get(_itself(n), env[n]))
    for user in list(call.users):
        if user.target is not operator.getitem:
            raise UnsupportedModelError(f"{describe_node(user)} reads a grad-mode region's results whole; "
                                        "autopar inlines regions whose results are read by index")
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)


def _itself(node: fx.Node) -> fx.Node:
    """The node whose very tensor `node`'s is: through casts that change nothing, which
    eager answers with their input (torch says which, on the traced values)."""
    while node.op == "call_function" and getattr(node.target, "overloadpacket", None) in _MAYBE_ITSELF:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        if node.target(*args, **kwargs) is not args[0]:
            break
        node = node.args[0]
    return node


def _is_tensor(value: object) -> bool:
    return isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor)


def _lifted(gm: fx.GraphModule, body: fx.GraphModule, node: fx.Node) -> fx.Node:
    name, i = f"{node.target}_inlined", 0
    while hasattr(gm, f"{name}{i}"):
        i += 1
    gm.add_submodule(f"{name}{i}", getattr(body, node.target))
    lifted = gm.graph.get_attr(f"{name}{i}")
    lifted.meta = dict(node.meta)
    return lifted
