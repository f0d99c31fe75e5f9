"""Relay values that skip pipeline stages through every stage in between.

torch.distributed.pipelining sends a stage's output straight to every stage that reads
it, but takes a gradient back from one reader only: its traced stage marks every floating
output as needing a gradient (torch 2.13 `_create_grad_recv_info`, whether or not the
value requires one) and raises "Backward of skip connections not supported yet" for an
output with two readers. Its interleaved schedule moves values between adjacent stages
only. Llama's rotary tables (made once before the first block from the inv_freq buffer,
read by every block) and its causal mask are such values.

Before (torch's split graph; stage 0 makes the rotary table `cos`):

    h0, cos = s0(ids)
    h1 = s1(h0, cos);   h2 = s2(h1, cos);   h3 = s3(h2, cos)

After: each stage between the maker and the last reader takes the value as one more
input (or uses the input it already reads it by) and returns it as one more output, so
every value crosses one boundary at a time and each output has one reader:

    h0, cos = s0(ids)
    h1, cos_1 = s1(h0, cos)       # s1 reads cos and passes it on
    h2, cos_2 = s2(h1, cos_1)
    h3 = s3(h2, cos_2)

Its gradient comes back the same way: the relaying stage's gradient for the input is the
relay output's gradient plus that of its own use (the runtime returns a copy of the input,
so autograd sums the two).

Why a relay and not the alternatives: recomputing the value in each reader works only
for values made from buffers and integers (the rotary tables, not a hidden state read two
stages later) and would copy the maker's ops and buffers into every stage's program; and
torch's pipelining has no skip-gradient path to switch on. A relay needs to know nothing
about how the value was made, and the planner already prices it: passes/plan/pipeline.py
charges a value at every boundary between its maker and its last reader.

1. Find the stages (call_module nodes, in order: torch numbers stages so) and, per value a
   stage makes, its readers further than the next stage. Only values `must_relay` picks
   (by their example value) are relayed: the runtime picks floating ones in training and
   all under the interleaved schedule; torch sends the rest (GPT-2's boolean mask, values
   in inference) straight to every reader, one send each instead of a chain.
2. For each such value, walk the stages in between: add the relay input (or reuse the one
   the stage reads the value by) and a relay output, whose getitem carries the value on.
3. Each changed stage gets a new GraphModule (the old one, which its own program is
   planned from, is left as it was); `Relayed` says how the two differ.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import fx

from autopar.core.pipeline import PipelineError


@dataclass(frozen=True)
class Relayed:
    """How a stage's relayed module extends its own: inputs past `inputs` are relay
    inputs; its own outputs come first (`outputs` of them, or one value returned bare
    when None), then one relay output per entry of `passed`, the input index it returns."""

    inputs: int
    outputs: Optional[int]
    passed: tuple[int, ...]


@dataclass
class _Edit:
    """A stage's graph being extended (step 2): the copy, its placeholders and output."""

    graph: fx.Graph
    placeholders: list[fx.Node]
    own: list[Any]  # its own output values
    bare: bool  # it returned one value, not a tuple
    relays: list[int] = field(default_factory=list)


def relay_skips(split_gm: fx.GraphModule, must_relay: Callable[[Any], bool]) -> dict[int, Relayed]:
    """Rewrite torch's split graph in place so that every stage output `must_relay` picks
    is read by the next stage only (steps 1-3); returns how each changed stage's module
    differs, by stage index."""
    # 1.
    stages = [n for n in split_gm.graph.nodes if n.op == "call_module"]
    index = {n: k for k, n in enumerate(stages)}
    edits: dict[int, _Edit] = {}
    for i, stage in enumerate(stages):
        for value in _outputs(stage):
            readers = [index[u] for u in value.users if u in index]
            if readers and max(readers) > i + 1 and must_relay(_value_meta(split_gm, value)):
                # 2.
                _relay(split_gm, stages, edits, value, i, max(readers))
    # 3.
    relayed = {}
    for k, edit in edits.items():
        own = split_gm.get_submodule(stages[k].target)
        relayed[k] = Relayed(len(_placeholders(own.graph)), None if edit.bare else len(edit.own), tuple(edit.relays))
        outs = tuple(edit.own) + tuple(edit.placeholders[j] for j in edit.relays)
        edit.graph.output(outs)
        split_gm.add_submodule(stages[k].target, fx.GraphModule(own, edit.graph, class_name=type(own).__name__))
    split_gm.graph.lint()
    split_gm.recompile()
    return relayed


def _relay(split_gm: fx.GraphModule, stages: list[fx.Node], edits: dict[int, _Edit], value: fx.Node,
           maker: int, last: int) -> None:
    """Step 2 for one value made by stage `maker` and last read by stage `last`."""
    val = _value_meta(split_gm, value)
    carrier = value
    for k in range(maker + 1, last + 1):
        node = stages[k]
        node.args = tuple(carrier if a is value else a for a in node.args)
        if k == last:
            return
        edit = edits.get(k) or edits.setdefault(k, _edit(split_gm, node))
        if carrier in node.args:
            j = node.args.index(carrier)
        else:
            j = len(node.args)
            node.args = node.args + (carrier,)
            with edit.graph.inserting_after(edit.placeholders[-1]):
                edit.placeholders.append(edit.graph.placeholder(f"relay_{value.name}"))
            edit.placeholders[-1].meta["val"] = val
        edit.relays.append(j)
        carrier = _output_node(split_gm, node, len(edit.own) + len(edit.relays) - 1, edit.bare)
        carrier.meta["val"] = val


def _edit(split_gm: fx.GraphModule, node: fx.Node) -> _Edit:
    """A copy of the stage's graph without its output node, ready to be extended."""
    own = split_gm.get_submodule(node.target)
    graph, env = fx.Graph(), {}
    out = graph.graph_copy(own.graph, env)
    bare = not isinstance(out, (tuple, list))
    placeholders = [env[p] for p in _placeholders(own.graph)]
    if not placeholders:
        raise PipelineError(f"stage {node.name} takes no input, so it cannot pass a value on; "
                            "split the model at other blocks")
    return _Edit(graph, placeholders, [out] if bare else list(out), bare)


def _output_node(split_gm: fx.GraphModule, stage: fx.Node, out_index: int, bare: bool) -> fx.Node:
    """The getitem of the stage's output `out_index` in the split graph. A stage that
    returned one value bare returns a tuple from now on: its readers take item 0 (made
    first, so torch, which numbers a stage's outputs by its getitem users in order,
    numbers them right)."""
    graph = split_gm.graph
    if bare and not any(u.target is operator.getitem for u in stage.users):
        with graph.inserting_after(stage):
            first = graph.call_function(operator.getitem, (stage, 0))
        stage.replace_all_uses_with(first, delete_user_cb=lambda u: u is not first)
    items = [u for u in stage.users if u.op == "call_function" and u.target is operator.getitem]
    if [u.args[1] for u in items] != list(range(len(items))) or len(items) != len(stage.users):
        raise PipelineError(f"stage {stage.name}'s outputs are not read one getitem per output in order "
                            f"({stage.format_node()}); torch's pipeline() split was not as expected")
    with graph.inserting_after(items[-1]):
        return graph.call_function(operator.getitem, (stage, out_index))


def _outputs(stage: fx.Node) -> list[fx.Node]:
    """The split-graph nodes holding a stage's outputs: its getitems, or itself."""
    items = [u for u in stage.users if u.op == "call_function" and u.target is operator.getitem]
    return items or [stage]


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _value_meta(split_gm: fx.GraphModule, value: fx.Node) -> Any:
    """The example value (meta["val"]) the making stage's graph has for this output,
    which torch reads a relay input's shape and dtype from."""
    stage, item = (value.args[0], value.args[1]) if value.op == "call_function" else (value, None)
    out = next(n for n in split_gm.get_submodule(stage.target).graph.nodes if n.op == "output").args[0]
    node = out[item] if isinstance(out, (tuple, list)) else out  # item 0 of a stage made to return a tuple
    if not isinstance(node, fx.Node) or "val" not in node.meta:
        raise PipelineError(f"stage {stage.name}'s output {value.name} has no example value to relay it by")
    return node.meta["val"]

