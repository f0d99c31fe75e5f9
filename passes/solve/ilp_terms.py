"""The linear pieces passes/solve/ilp.py builds its ILP from: sums of terms over columns, and
the flow variables x of one edge between groups with their cost terms.

    LinearTerms               sum_v a_v v + constant
    merge_alike(src, dst, M)  classes with equal rows (columns) of M merged
    link_classes(prob, ...)   an edge's constraints and its cost terms (and, for an edge
                              into a recomputable block, its forward steps' terms too)

Apart from ilp.py so that the recompute family (passes/solve/recompute_ilp.py) can use them
without importing the ILP that imports it."""

from __future__ import annotations

from typing import Optional

from autopar.cost_models.edge_prices import INF
from autopar.passes.solve.solver_backend import LinearProgram

US = 1e6  # the time objective is in microseconds, which keeps coefficients well scaled
MIB = 2**20  # the memory objective is in MiB, for the same reason

Variable = Optional[int]  # a column of the LinearProgram; None: a choice that is impossible, i.e. fixed at 0
Classes = list[list[int]]  # per class, the s variables that choose it
Matrix = list[list]  # per (src class, dst class): R, or the pair (R, F) where forward terms are wanted
# a flow x[e,o,r] and the s columns of its src class o and its dst class r: under a one-hot
# choice x is 1 exactly where both classes are chosen (what a whole starting solution sets)
Flow = tuple[int, tuple[int, ...], tuple[int, ...]]


class LinearTerms:
    """sum_v a_v v + constant, accumulated per variable (column)."""

    def __init__(self) -> None:
        self.coef: dict[int, float] = {}
        self.constant = 0.0

    def add(self, var: Variable, c: float) -> None:
        if var is None:
            self.constant += c
        elif c:
            self.coef[var] = self.coef.get(var, 0.0) + c

    def extend(self, other: LinearTerms) -> None:
        self.constant += other.constant
        for var, c in other.coef.items():
            self.coef[var] = self.coef.get(var, 0.0) + c

    def upper_bound(self, prob: LinearProgram) -> float:
        """The largest value the terms take over the columns' bounds (every coefficient
        is >= 0 here: costs and bytes), for the big-M rows of passes/solve/recompute_ilp.py."""
        return self.constant + sum(c * min(prob.upper[v], 1.0) for v, c in self.coef.items())


def merge_alike(src: Classes, dst: Classes, matrix: Matrix) -> tuple[Classes, Classes, Matrix]:
    """Merges src classes with equal rows of R, then dst classes with equal columns,
    until none are left. Exact, for the LP relaxation too: a flow into two equal
    columns splits in proportion to their marginals, at the same cost, and back."""
    while True:
        rows: dict[tuple, int] = {}
        merged_src: Classes = []
        for vars_, row in zip(src, matrix):
            k = rows.setdefault(tuple(row), len(rows))
            if k == len(merged_src):
                merged_src.append([])
            merged_src[k].extend(vars_)
        cols: dict[tuple, int] = {}
        merged_dst: Classes = []
        for r, vars_ in enumerate(dst):
            k = cols.setdefault(tuple(row[r] for row in rows), len(cols))
            if k == len(merged_dst):
                merged_dst.append([])
            merged_dst[k].extend(vars_)
        if len(merged_src) == len(src) and len(merged_dst) == len(dst):
            return src, dst, matrix
        columns = list(cols)
        src, dst, matrix = merged_src, merged_dst, [list(row) for row in zip(*columns)]


def link_classes(prob: LinearProgram, src: Classes, dst: Classes, matrix: Matrix, with_forward: bool = False,
                 flows: Optional[list[Flow]] = None) -> tuple[LinearTerms, LinearTerms, int]:
    """An edge's constraints and cost terms, without x where a side has one class; with
    `with_forward` the entries of `matrix` are pairs (R, F) and the forward terms
    sum F x come back too, listing every x of the edge (else empty terms). Each x made
    is appended to `flows` with its classes' s columns."""
    cost = [[(p[0] if with_forward else p) for p in row] for row in matrix]
    fwd = [[(p[1] if with_forward else 0.0) for p in row] for row in matrix]
    terms, forward = LinearTerms(), LinearTerms()
    if len(src) == 1 and len(dst) == 1 and cost[0][0] < INF:
        terms.add(None, cost[0][0] * US)
        forward.add(None, fwd[0][0] * US)
        return terms, forward, 0
    if len(src) == 1 or len(dst) == 1:
        for o, vars_o in enumerate(src):
            for r, vars_r in enumerate(dst):
                for var in (vars_r if len(src) == 1 else vars_o):
                    add_or_forbid(prob, terms, var, cost[o][r])
                    forward.add(var, fwd[o][r] * US if cost[o][r] < INF else 0.0)
        return terms, forward, 0
    by_src: list[dict[int, float]] = [{var: -1.0 for var in vars_} for vars_ in src]
    by_dst: list[dict[int, float]] = [{var: -1.0 for var in vars_} for vars_ in dst]
    created = 0
    src_t, dst_t = [tuple(v) for v in src], [tuple(v) for v in dst]  # one tuple per class, shared by its flows
    for o, row in enumerate(cost):
        for r, c in enumerate(row):
            if c < INF:
                x = prob.column(binary=False, priced=True)
                terms.add(x, c * US)
                forward.coef[x] = fwd[o][r] * US  # zero too: every flow of the edge is listed
                by_src[o][x] = by_dst[r][x] = 1.0
                created += 1
                if flows is not None:
                    flows.append((x, src_t[o], dst_t[r]))
    for coef in by_src + by_dst:  # sum of the flows = the marginal, as sum coef[v] v = 0
        prob.row(coef, 0.0, 0.0)
    return terms, forward, created


def add_or_forbid(prob: LinearProgram, terms: LinearTerms, var: int, cost_s: float) -> None:
    if cost_s == INF:
        prob.fix_zero(var)
    else:
        terms.add(var, cost_s * US)
