"""Solving an ILP whose flow columns are too many to hand the solver at once: column
generation over the flows, with reduced-cost fixing to keep the optimum exact.

On a mesh of three axes an edge between two groups has a few hundred classes on each
side, and its flows x[e,o,r] (passes/solve/ilp.py) number their product: the Llama-3-8B
shape, 2 layers on (2, 2, 2), 1.9 M columns, of which HiGHS needs about 90 thousand.

    master   the ILP's rows, every column that is not priced, and the priced columns
             (ilp_terms.link_classes' flows) the starting solution uses: a feasible ILP
    price    solve the master's LP relaxation; for every column left out,
             rc_j = c_j - a_j . y  (y: the row duals); the most negative join, until
             none is negative: the master's LP optimum is then the whole ILP's LP optimum
             z_LP, a lower bound on every plan
    MIP      the master as an ILP, from the starting solution: its optimum z
    close    every column left out with rc_j <= z - z_LP joins, and the master is solved
             again from z's plan. A plan using a column still out costs at least
             z_LP + rc_j > z, since c.x >= z_LP + sum_{rc_j > 0} rc_j x_j for every
             feasible x and a flow is 0 or 1 in every integral plan; so the master's
             optimum is the whole ILP's.

Under a memory budget the solve goes whole: there the master's LP, with the memory row and
the recompute family's big-M rows, grows slow to re-solve as columns join (the 4-layer
Llama-3-8B shape on (2, 2, 2) under 70 GiB: past 300 s without converging, against HiGHS's
whole solve stopping at its 120 s limit with the same plan).

Where the gap z - z_LP lets in more columns than CLOSE_AT_MOST, the close is skipped: the
plan is z's, reported Feasible with z_LP as its proven bound (its gap printed in the
summary) rather than a solve of the whole ILP that does not end in its time limit. The LP
relaxation is weak on three axes: two layers on (2, 2, 2) lie 1.2 % between the LP and the
starting plan, a gap that would let in 1.6 M of the 1.9 M flows.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

import numpy as np

from autopar.core.log import LOG
from autopar.core.options import Options
from autopar.passes.solve.solver_backend import (LinearProgram, Solution, SolveStatus, Start, highs_outcome, highspy,
                                                 quiet_highs, solve_program, solver_name)

PRICED_FROM = 250_000  # fewer priced columns than this: the whole ILP goes to the solver at once
ADD_PER_ROUND = 50_000  # the most negative reduced costs that join the master per LP round
CLOSE_AT_MOST = 250_000  # the close step's columns beyond which the plan is returned with its LP bound
TOLERANCE = 1e-6  # of the objective (microseconds): a reduced cost below -TOLERANCE is negative


def solve_ilp(program: LinearProgram, options: Options, start: Optional[Start] = None,
              by_columns: bool = True) -> Solution:
    """solve_program, by column generation where `by_columns`, HiGHS solves, the program has
    at least PRICED_FROM priced columns and `start` sets every column (a feasible master)."""
    complete = start is not None and len(start[0]) == len(program.cost)
    if not (by_columns and complete) or solver_name(options) != "highs" or sum(program.priced) < PRICED_FROM:
        return solve_program(program, options, start)
    return solve_by_columns(program, options, start)


class _Columns:
    """The program's columns, column-wise, for the master and for pricing."""

    def __init__(self, p: LinearProgram) -> None:
        starts = np.asarray(p.row_start, dtype=np.int64)
        self.index = np.asarray(p.row_index, dtype=np.int64)
        self.value = np.asarray(p.row_value, dtype=np.float64)
        self.row_of = np.repeat(np.arange(p.num_rows, dtype=np.int64), np.diff(starts))
        order = np.argsort(self.index, kind="stable")
        self.rows, self.values = self.row_of[order].astype(np.int32), self.value[order]
        counts = np.bincount(self.index, minlength=len(p.cost))
        self.start = np.concatenate([[0], np.cumsum(counts)])
        self.cost = np.asarray(p.cost, dtype=np.float64)
        self.lower, self.upper = np.asarray(p.lower, dtype=np.float64), np.asarray(p.upper, dtype=np.float64)

    def reduced_costs(self, duals: np.ndarray) -> np.ndarray:
        return self.cost - np.bincount(self.index, weights=self.value * duals[self.row_of], minlength=len(self.cost))

    def add_to(self, h, columns: np.ndarray) -> None:
        """Appends `columns` (program indices) to the HiGHS model, in that order."""
        lengths = self.start[columns + 1] - self.start[columns]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int32)
        at = np.repeat(self.start[columns] - starts, lengths) + np.arange(int(lengths.sum()))
        h.addCols(len(columns), self.cost[columns], self.lower[columns], self.upper[columns], len(at), starts,
                  self.rows[at], self.values[at])


def solve_by_columns(p: LinearProgram, options: Options, start: Start) -> Solution:
    """The module docstring's steps, within options.time_limit_s, to options.mip_gap. Where
    the master's LP has no optimum (a start over a memory budget makes it infeasible), the
    whole program goes to the solver with the time that is left."""
    t0 = time.perf_counter()
    deadline = t0 + options.time_limit_s
    cols = _Columns(p)
    priced = np.asarray(p.priced, dtype=bool)
    first = np.zeros(len(p.cost))
    first[start[0]] = start[1]
    h = quiet_highs()
    empty = np.zeros(0, dtype=np.int32)
    h.addRows(p.num_rows, np.asarray(p.row_lower), np.asarray(p.row_upper), 0, empty, empty, np.zeros(0))
    h.changeObjectiveOffset(p.constant)
    master = np.flatnonzero(~priced | (first > 0.5))
    cols.add_to(h, master)
    inside = np.zeros(len(p.cost), dtype=bool)
    inside[master] = True
    z_lp, reduced, joined = _price(h, cols, priced, inside, deadline)
    LOG.info("column generation: LP %s over %d of %d columns, %.1f s", "no optimum" if z_lp is None else f"{z_lp:.1f}",
             len(master) + len(joined), len(p.cost), time.perf_counter() - t0)
    if z_lp is None and time.perf_counter() < deadline:
        left = replace(options, time_limit_s=max(1.0, deadline - time.perf_counter()))
        return solve_program(p, left, start)
    master = np.concatenate([master, joined])
    status, values, z, gap, bound = _master_mip(h, p, master, first[master], options.mip_gap, deadline)
    if reduced is None:
        bound = None  # the master's bound is its own, not the whole program's
    elif status is SolveStatus.OPTIMAL and z - z_lp <= options.mip_gap * max(1.0, abs(z)):
        bound = z_lp  # the LP's bound already proves the master's plan within the gap
    elif status is SolveStatus.OPTIMAL:
        near = np.flatnonzero(priced & ~inside & (reduced <= z - z_lp + TOLERANCE * max(1.0, abs(z))))
        LOG.info("column generation: master ILP %.1f, %d columns within its gap to the LP, %.1f s", z, len(near),
                 time.perf_counter() - t0)
        if 0 < len(near) <= CLOSE_AT_MOST:
            cols.add_to(h, near)
            master = np.concatenate([master, near])
            status, values, z, gap, bound = _master_mip(h, p, master, _padded(values, len(near)), options.mip_gap,
                                                        deadline, integral_from=len(master) - len(near))
        elif len(near):
            status, bound = SolveStatus.FEASIBLE, z_lp
            gap = (z - z_lp) / max(abs(z), 1e-9)
    elif status is SolveStatus.FEASIBLE:
        bound = z_lp if bound is None else min(bound, z_lp)  # a plan outside the master costs at least z_lp
    full = np.zeros(len(p.cost))
    full[master] = values
    return Solution(status, tuple(full), z, gap, time.perf_counter() - t0, bound)


def _padded(values: np.ndarray, extra: int) -> np.ndarray:
    return np.concatenate([values, np.zeros(extra)])


def _price(h, cols: _Columns, priced: np.ndarray, inside: np.ndarray, deadline: float
           ) -> tuple[Optional[float], Optional[np.ndarray], np.ndarray]:
    """The price step: the LP optimum over every column and the reduced costs at it (None,
    None where the time ran out or the LP has no optimum), and the columns that joined the
    master, in the order they joined."""
    joined: list[np.ndarray] = [np.zeros(0, dtype=np.int64)]
    while True:
        _limit(h, deadline)
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            LOG.info("column generation: the master's LP is %s", h.modelStatusToString(h.getModelStatus()))
            return None, None, np.concatenate(joined)
        reduced = cols.reduced_costs(np.asarray(h.getSolution().row_dual))
        z_lp = h.getInfo().objective_function_value
        candidates = np.flatnonzero(priced & ~inside & (reduced < -TOLERANCE * max(1.0, abs(z_lp))))
        if not len(candidates):
            return z_lp, reduced, np.concatenate(joined)
        if len(candidates) > ADD_PER_ROUND:
            candidates = candidates[np.argsort(reduced[candidates], kind="stable")[:ADD_PER_ROUND]]
            candidates.sort()
        cols.add_to(h, candidates)
        inside[candidates] = True
        joined.append(candidates)


def _limit(h, deadline: float) -> None:
    """HiGHS's time limit for its next run: its run clock counts every run of the same
    model, so the limit is what it has run plus what is left to the deadline."""
    h.setOptionValue("time_limit", h.getRunTime() + max(0.1, deadline - time.perf_counter()))


def _master_mip(h, p: LinearProgram, master: np.ndarray, start: np.ndarray, gap: float, deadline: float,
                integral_from: int = 0) -> tuple[SolveStatus, np.ndarray, float, Optional[float], Optional[float]]:
    """The master as an ILP (its binary columns from `integral_from` on made integral),
    started from `start` (its columns' values)."""
    binary = np.asarray(p.binary, dtype=bool)[master]
    integral = np.flatnonzero(binary[integral_from:]).astype(np.int32) + integral_from
    if len(integral):
        h.changeColsIntegrality(len(integral), integral, np.full(len(integral), highspy.HighsVarType.kInteger))
    h.setOptionValue("mip_rel_gap", float(gap))
    _limit(h, deadline)
    h.setSolution(len(master), np.arange(len(master), dtype=np.int32), start)
    h.run()
    status, values, objective, found_gap, bound = highs_outcome(h, len(master), mip=True)
    return status, np.asarray(values), objective, found_gap, bound
