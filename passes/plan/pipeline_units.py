"""The prices of the units a pipeline stage is made of (steps 2 and 3 of passes/plan/pipeline.py).

    sub-mesh plan of the microbatch graph  ->  Units (each block's seconds and bytes)
    its leaner plans (memory priced)       ->  more Units, one per point of the frontier

Each node's price in a sub-mesh plan (its compute, the reshards into it, and where the
plan recomputes a block, that block's forward once more) goes to its unit: a block, or the
part before the blocks (stage 0) or after them (last stage). Each boundary after block j
carries the activations produced at or before j and read after it.

Bytes per unit are the plan's own: a parameter in the layout it is stored in (sharded
where the plan gathers it at use), its gradient and optimiser state in proportion, and
the op outputs backward keeps for one microbatch, less those of a recomputed block read
only inside it (what Plan.memory_bytes counts, split by unit).

Under a memory budget the fastest plan's units may fit no split. lean_frontier then solves
the same graph with memory priced (passes/solve/solve.py, memory_price): each price gives
a plan storing more parameters sharded or recomputing more blocks, a point further along
the time-memory frontier. Twin blocks get alike choices at one price, so a point's
per-block figures hold wherever the block lands; the stage DP takes, for each stage, the
fastest point whose bytes fit (passes/plan/pipeline_split.py).
"""

from __future__ import annotations

from dataclasses import replace

from autopar.core.kinds import NodeKind
from autopar.core.links import link_overrides
from autopar.core.plan import Plan
from autopar.cost_models.evaluate import op_target, recompute_terms
from autopar.cost_models.memory import node_bytes
from autopar.cost_models.model import CostModel
from autopar.core.options import Options
from autopar.core.pipeline import PipelineError
from autopar.passes.plan.pipeline_split import Units
from autopar.passes.plan.planning import plan_annotated
from autopar.passes.strategies.clusters import find_blocks
from autopar.passes.strategies.strategies import AnnotatedGraph
from autopar.core.errors import SolverError

# memory prices of the frontier's points, in multiples of the fastest plan's seconds per
# byte (its step / its bytes): at 1 a plan gives up 1 % of its step for 1 % of its bytes
FRONTIER_PRICES = (1.0, 8.0, 64.0, 1024.0)
# the relative gap a frontier point is solved to: a sample of the trade-off the stage DP
# picks from (each stage's own plan is solved afterwards, to Options.mip_gap); the 405B
# shape's first point ran to its 120 s time limit at a gap of 0.16 %
FRONTIER_GAP = 0.01


def units_of(graph: AnnotatedGraph, plan: Plan, costs: CostModel) -> Units:
    """Each node's price and bytes in `plan` assigned to its block, or before/after."""
    container, position = _positions(graph)
    blocks = max(position.values()) if position else 0
    price = {n.name: n.compute_s for n in plan.nodes}
    for e in plan.edges:
        price[e.consumer] = price.get(e.consumer, 0.0) + e.comm_s
    block_s = [0.0] * blocks
    before_s = after_s = 0.0
    for n in graph.nodes:
        p = position[n.name]
        if p < 0:
            before_s += price[n.name]
        elif p >= blocks:
            after_s += price[n.name]
        else:
            block_s[p] += price[n.name]
    params, state, acts = _unit_bytes(plan, position, blocks)
    for block in plan.recompute:  # its forward once more; its inner outputs not kept
        again = recompute_terms(plan.nodes, plan.edges, (block,), costs)
        unit = min(max(position[block.nodes[0]], 0), blocks - 1)
        block_s[unit] += again.compute_s + again.comm_s
        acts[unit] += again.memory_bytes
    return Units(container, tuple(block_s), before_s, after_s, _boundary_bytes(graph, position, blocks),
                 tuple(params), tuple(state), tuple(acts))


def stage_costs(options: Options, plan: Plan) -> CostModel:
    """The analytic prices of `plan`'s sub-mesh (the recompute terms of units_of)."""
    return CostModel.analytic(options.device, plan.mesh.shape, plan.training, options.nodes,
                              link_overrides(options.links))


def lean_frontier(graph: AnnotatedGraph, fastest: Plan, options: Options) -> tuple[Units, ...]:
    """Units of the sub-mesh plans with memory priced at FRONTIER_PRICES (module docstring),
    leanest last; a price whose solve fails is left out."""
    scale = fastest.total_s / max(fastest.memory_bytes, 1)
    costs = stage_costs(options, fastest)
    options = replace(options, mip_gap=max(options.mip_gap, FRONTIER_GAP))
    out = []
    for factor in FRONTIER_PRICES:
        try:
            plan = plan_annotated(graph, options, memory_price=scale * factor)
        except SolverError:
            continue
        out.append(units_of(graph, plan, costs))
    return tuple(out)


def _unit_bytes(sub: Plan, position: dict[str, int], blocks: int) -> tuple[list[int], list[int], list[int]]:
    """Each block's (parameter, gradient + optimiser state, kept activation) bytes per rank
    in the sub-mesh plan; what comes before the blocks counts with block 0 and what comes
    after with the last (their stages hold them). The state is the plan's, shared out in
    proportion to the bytes of floating parameters (buffers have none)."""
    params, trained, acts = [0] * blocks, [0] * blocks, [0] * blocks
    shape = sub.mesh.shape
    for n in sub.nodes:
        p = min(max(position[n.name], 0), blocks - 1)
        if n.kind.is_state:
            params[p] += n.outputs[0].local_nbytes(shape)
            if n.kind is NodeKind.PARAMETER and n.outputs[0].meta.dtype.is_floating_point:
                trained[p] += n.outputs[0].local_nbytes(shape)
        elif n.kind.computes:
            acts[p] += node_bytes(n.kind, op_target(n.op, n.name), n.outputs, shape, sub.training, 0, n.saved)
        elif n.kind is NodeKind.OUTPUT:  # what the last stage returns (its stage plan counts it too)
            acts[p] += node_bytes(n.kind, None, n.outputs, shape, sub.training, 0, n.saved, n.inputs)
    state = [sub.state_bytes * b // max(sum(trained), 1) for b in trained]
    return params, state, acts


def _positions(graph: AnnotatedGraph) -> tuple[str, dict[str, int]]:
    """The block container with the most blocks, and each node's place: its block's rank
    among them, -1 before the first block, len(blocks) after the last."""
    block_of = find_blocks(graph)
    counts: dict[str, set[int]] = {}
    for container, index in block_of.values():
        counts.setdefault(container, set()).add(index)
    if not counts:
        raise PipelineError(f"model {graph.traced.model_name} has no repeated blocks (a ModuleList of layers such "
                            "as transformer.h.0, transformer.h.1, ...) to split into pipeline stages; plan it "
                            "without pipeline_axis")
    container = min(counts, key=lambda c: (-len(counts[c]), c))
    order = {index: rank for rank, index in enumerate(sorted(counts[container]))}
    inside = [i for i, n in enumerate(graph.nodes)
              if not n.kind.is_input and block_of.get(n.name, ("", 0))[0] == container]
    first, last, blocks = inside[0], inside[-1], len(order)
    position, current = {}, -1
    for i, n in enumerate(graph.nodes):
        key = block_of.get(n.name)
        if key is not None and key[0] == container:
            position[n.name] = order[key[1]]
            if not n.kind.is_input:  # a block's parameters come first, before any op
                current = position[n.name]
        elif n.kind.is_input:  # graph inputs come first; a parameter lives with its reader
            position[n.name] = -1
        else:  # nodes between blocks go with the block before them
            position[n.name] = -1 if i < first else (blocks if i > last else current)
    return container, position


def _boundary_bytes(graph: AnnotatedGraph, position: dict[str, int], blocks: int) -> tuple[int, ...]:
    """Bytes of the values made at or before block j and read after it, per boundary j."""
    crossing = [0] * max(blocks - 1, 0)
    last_use: dict[str, int] = {}
    for v in graph.nodes:
        for u, _ in v.inputs:
            last_use[u] = max(last_use.get(u, -1), position[v.name])
    for n in graph.nodes:
        if n.kind.is_state or n.kind is NodeKind.CONSTANT or not n.strategies or n.name not in last_use:
            continue
        nbytes = sum(o.meta.nbytes for o in n.strategies[0].outputs)
        for j in range(max(position[n.name], 0), min(last_use[n.name], blocks - 1)):
            crossing[j] += nbytes
    return tuple(crossing)
