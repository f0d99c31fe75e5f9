"""Stage 6: order a rank program so that its collectives run beside independent compute.

    before:  a = mm(x, w1);  s = start(a);  r = wait(s);  b = add(r, y);  c = mm(z, w2)
    after:   a = mm(x, w1);  s = start(a);  c = mm(z, w2);  r = wait(s);  b = add(r, y)

A communicating reshard step is two nodes (passes/lower/program.py): its start issues the
collective, its wait hands over the result. Between them the rank computes whatever
does not need the result. Backward follows: the wait's backward launches the conjugate
collective and the start's backward finishes it (autopar/runtime/step_runner.py), so a
start placed early is also a backward collective finished late.

1. Starts are issued as soon as their input exists; starts ready at once go in their
   original order. The order is a function of the program alone, so every rank, running
   the same program, issues one order of collectives on every process group. A start
   whose input is still missing holds back no other (a two-step reshard's second start
   waits for its first step's result, and the activations started behind it need not:
   each runs beside the compute between its producer and its consumer, the window
   cost_models/overlap.py prices).
2. A start whose input is a program input (a parameter's gather, FSDP's) is also issued
   no later than right after the previous use of any program input's collective, ahead
   of its turn if need be, so it runs beside at least the compute between the two uses
   (the window cost_models/overlap.py prices); the first ones at the program's start.
3. A wait is placed just before the first node that uses its result.
4. At most `cap_bytes` are in flight: before a start that would exceed it, the oldest
   collectives in flight are waited on first (one collective alone may exceed the cap).
Nodes keep their names; the graph's meaning does not change, only its order.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from torch import fx

from autopar.core.kinds import StepKind
from autopar.core.options import INFLIGHT_CAP_BYTES
from autopar.core.resharding import Step
from autopar.passes.lower.program import StepModule, WaitModule



def inflight_bytes(step: Step, mesh_shape: tuple[int, ...]) -> int:
    """Bytes a collective holds while in flight: its input, or its output where larger."""
    if step.before is None:
        return 0
    local = step.before.local_nbytes(mesh_shape)
    return local * mesh_shape[step.axis] if step.kind is StepKind.ALL_GATHER else local


def schedule(gm: fx.GraphModule, mesh_shape: tuple[int, ...], cap_bytes: int = INFLIGHT_CAP_BYTES) -> fx.GraphModule:
    """Reorder `gm`'s nodes in place (see the module docstring); returns gm."""
    order = _Order(gm, mesh_shape, cap_bytes)
    for node in order.body:
        order.require(node)
        order.issue_ready_starts()
    order.require(order.output)
    _apply(gm, order.emitted)
    return gm


class _Order:
    """The new node order, built by emitting nodes as they become needed or possible."""

    def __init__(self, gm: fx.GraphModule, mesh_shape: tuple[int, ...], cap_bytes: int) -> None:
        self.mesh_shape, self.cap_bytes = mesh_shape, cap_bytes
        nodes = list(gm.graph.nodes)
        self.waits = {n for n in nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), WaitModule)}
        self.starts = [n for n in nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), StepModule)
                       and any(u in self.waits for u in n.users)]
        self.wait_of = {s: next(u for u in s.users if u in self.waits) for s in self.starts}
        self.start_of = {w: s for s, w in self.wait_of.items()}
        self.bytes = {s: inflight_bytes(gm.get_submodule(s.target).step, mesh_shape) for s in self.starts}
        start_set = set(self.starts)
        self.emitted: list[fx.Node] = [n for n in nodes if n.op == "placeholder"]
        self.done = set(self.emitted)
        self.output = next(n for n in nodes if n.op == "output")
        self.body = [n for n in nodes if n.op not in ("placeholder", "output")
                     and n not in start_set and n not in self.waits]
        self.inflight: OrderedDict[fx.Node, int] = OrderedDict()
        # 1. starts whose inputs all exist, by original order; a start joins when its last input is emitted
        self.turn = {s: i for i, s in enumerate(self.starts)}
        self.missing = {s: len(set(s.all_input_nodes) - self.done) for s in self.starts}
        self.waiting_on: dict[fx.Node, list[fx.Node]] = {}
        for s in self.starts:
            for d in set(s.all_input_nodes) - self.done:
                self.waiting_on.setdefault(d, []).append(s)
        self.ready: list[int] = [i for i, s in enumerate(self.starts) if not self.missing[s]]
        heapq.heapify(self.ready)
        # 2. prefetched starts, each issued by the previous use (a trigger node) at the latest
        self.prefetched: dict[fx.Node, list[fx.Node]] = {}
        for start in self._prefetch_triggers():
            self._issue(start)
        self.issue_ready_starts()

    def _is_prefetched(self, start: fx.Node) -> bool:
        return all(d.op == "placeholder" for d in start.all_input_nodes)

    def _first_use(self, start: fx.Node, index: dict[fx.Node, int]) -> int:
        """Body position of the first op that needs `start`'s result (through further steps)."""
        todo, best = [self.wait_of[start]], len(index)
        while todo:
            for u in todo.pop().users:
                if u in index:
                    best = min(best, index[u])
                elif u.op != "output":
                    todo.append(u)
        return best

    def _prefetch_triggers(self) -> list[fx.Node]:
        """Fill self.prefetched (trigger node -> starts issued after it); returns the starts
        whose use is the first one, issued at the program's start."""
        index = {n: i for i, n in enumerate(self.body)}
        uses: dict[int, list[fx.Node]] = {}
        for s in self.starts:
            if self._is_prefetched(s):
                uses.setdefault(self._first_use(s, index), []).append(s)
        positions = sorted(uses)
        for before, at in zip(positions, positions[1:]):
            if before < len(self.body):
                self.prefetched.setdefault(self.body[before], []).extend(uses[at])
        return uses[positions[0]] if positions else []

    def require(self, node: fx.Node) -> None:
        """Emit `node` after everything it needs."""
        if node in self.done:
            return
        if node in self.waits:
            self.require(self.start_of[node])
        elif node in self.wait_of:
            self._issue(node)
            return
        for dep in node.all_input_nodes:
            self.require(dep)
        self._emit(node)

    def issue_ready_starts(self) -> None:
        """Issue the starts whose inputs exist, in their original order, while the cap allows (step 1, 4)."""
        while self.ready:
            start = self.starts[self.ready[0]]
            if start in self.done:
                heapq.heappop(self.ready)
                continue
            if self.inflight and sum(self.inflight.values()) + self.bytes[start] > self.cap_bytes:
                return
            self._issue(start)

    def _issue(self, start: fx.Node) -> None:
        for dep in start.all_input_nodes:
            self.require(dep)
        while self.inflight and sum(self.inflight.values()) + self.bytes[start] > self.cap_bytes:
            self.require(self.wait_of[next(iter(self.inflight))])  # retire the oldest (step 4)
        self._emit(start)
        self.inflight[start] = self.bytes[start]

    def _emit(self, node: fx.Node) -> None:
        self.emitted.append(node)
        self.done.add(node)
        self.inflight.pop(self.start_of.get(node), None)
        for start in self.waiting_on.pop(node, ()):
            self.missing[start] -= 1
            if not self.missing[start]:
                heapq.heappush(self.ready, self.turn[start])
        for start in self.prefetched.pop(node, ()):  # 2. the uses after this one prefetch now
            if start not in self.done:
                self._issue(start)


def _apply(gm: fx.GraphModule, order: list[fx.Node]) -> None:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for node in order:
        output.prepend(node)
    gm.graph.lint()
    gm.recompile()
