"""Run the blocks a plan recomputes (Plan.recompute) under torch.utils.checkpoint.

    before:  a = addmm(x, w);  g = gelu(a);  b = addmm(g, w2);  y = add(x, b)      (block h.1)
    after:   ap_recompute_0 = self.ap_recompute_0(x, w, w2)     # checkpoint(body, x, w, w2)
             b = getitem(ap_recompute_0, 0);  y = add(x, b)

The body is a GraphModule of the block's nodes; `Recomputed` calls it through
torch.utils.checkpoint.checkpoint(use_reentrant=False): forward keeps only the body's
inputs, backward runs the body again (the RNG state restored, so dropout draws the same
mask) and then its backward. The reshard steps inside the body run again too, in the
same order on every rank (each rank's backward reaches the block at the same point),
and their backward conjugates once, as do the data-parallel gradient hooks of the
parameters read inside (autograd accumulates a leaf's gradient once per backward).

1. A block's members: the program nodes the plan names in the block, and every other
   node (a reshard step, a size computation) whose users are all members, e.g. the
   gather of a parameter the block reads (FSDP's gather again in backward).
2. Its inputs (values from outside read inside) and outputs (members read outside).
3. The body: a placeholder per input, the members copied, the outputs returned.
4. The call goes right after the last member; a node that reads the block's outputs but
   sat between its members moves after the call, in order. A block whose inputs depend
   on its own outputs cannot be one region: UnsupportedModelError names it.
Runs after rewrite, before schedule (passes/lower/emit.py), which orders each body on its own.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import fx, nn
from torch.utils.checkpoint import checkpoint

from autopar.core.errors import UnsupportedModelError
from autopar.core.plan import Plan
from autopar.core.plan_parts import RecomputedBlock


class Recomputed(nn.Module):
    """A block of a rank program run under checkpoint: `self.ap_recompute_0(x, w)`."""

    def __init__(self, body: fx.GraphModule, block: str) -> None:
        super().__init__()
        self.body = body
        self.block = block  # its module path, for reading the program

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.body, *args, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"recomputed in backward: {self.block}"


def checkpoint_blocks(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Every block of plan.recompute made one Recomputed call (module docstring); returns gm."""
    planned = {n.name for n in plan.nodes}
    for i, block in enumerate(plan.recompute):
        members = _members(gm, block, planned)
        if members:
            _extract(gm, block, members, f"ap_recompute_{i}")
    gm.delete_all_unused_submodules()
    gm.graph.lint()
    gm.recompile()
    return gm


def bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The body of every recomputed block in `gm`."""
    return [m.body for m in gm.modules() if isinstance(m, Recomputed)]


def _members(gm: fx.GraphModule, block: RecomputedBlock, planned: set[str]) -> list[fx.Node]:
    # 1. the block's nodes, and the unplanned nodes only they read
    names = set(block.nodes)
    inside = {n for n in gm.graph.nodes if n.name in names}
    for n in reversed(list(gm.graph.nodes)):
        if (n.op in ("call_module", "call_function") and n.name not in planned and n.users
                and all(u in inside for u in n.users)):
            inside.add(n)
    return [n for n in gm.graph.nodes if n in inside]


def _extract(gm: fx.GraphModule, block: RecomputedBlock, members: list[fx.Node], name: str) -> None:
    inside = set(members)
    # 2. inputs and outputs
    inputs = list(dict.fromkeys(a for n in members for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    later = _readers_of(outputs, inside)
    looped = [a.name for a in inputs if a in later]
    if looped:
        raise UnsupportedModelError(f"block {block.name} cannot be recomputed as one region: its inputs {looped} are "
                            "computed from its own outputs; plan without a memory budget (no recompute), or report the model")
    # 3. the body
    body = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = body.placeholder(a.name)
        env[a].meta.update(a.meta)
    for n in members:
        env[n] = body.node_copy(n, lambda a: env[a])
    body.output(tuple(env[o] for o in outputs))
    gm.add_module(name, Recomputed(fx.GraphModule(gm, body, class_name="RecomputedBlock"), block.name))
    # 4. the call after the last member; readers that sat among the members move after it
    graph = gm.graph
    with graph.inserting_after(members[-1]):
        call = graph.call_module(name, tuple(inputs))
    anchor = call
    for k, o in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, k))
        anchor.meta.update(o.meta)
        o.replace_all_uses_with(anchor, delete_user_cb=lambda u: u not in inside)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in [n for n in later if order[n] < order[call]]:
        anchor.append(n)
        anchor = n
    for n in reversed(members):
        graph.erase_node(n)


def _readers_of(outputs: list[fx.Node], inside: set[fx.Node]) -> set[fx.Node]:
    """Every node outside the block that reads its outputs, directly or not."""
    seen: set[fx.Node] = set()
    todo = [u for o in outputs for u in o.users if u not in inside]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return seen
