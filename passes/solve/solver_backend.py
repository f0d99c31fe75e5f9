"""The solver behind passes/solve/solve.py: a sparse 0-1 program, built as arrays, handed to
HiGHS through highspy's own model arrays (PuLP's bundled CBC when highspy is missing or
Options.solver says "cbc").

    LinearProgram  min cost . x + constant
                   row_lower <= A x <= row_upper      (A row-wise: start, index, value)
                   lower <= x <= upper, x binary where `binary`
    solve_program(LinearProgram, Options) -> Solution

Why not PuLP objects for HiGHS: the sharding ILP has 10^5 - 10^6 columns (the x flows of
passes/solve/ilp.py), and PuLP creates, names, sorts and copies one Python object per column
and per coefficient before HiGHS sees any of it: on hrm_text (2, 4) that cost more than
the solve itself. Here a column is an int and the matrix is handed over in one call.

Both solvers run with their own output off, so a solve leaves the process's stdout
alone: no file descriptor is redirected, and another thread printing during a solve is
still heard."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum
from functools import cache
from typing import Mapping, Optional

import numpy as np

from autopar.core.errors import SolverError
from autopar.core.options import Options, SolverChoice

try:
    import highspy
except ImportError:  # optional: without it the solver is CBC
    highspy = None


@dataclass
class LinearProgram:
    """Columns and rows as they are added (a builder: passes/solve/ilp.py fills it once)."""

    cost: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    binary: list[bool] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)
    row_start: list[int] = field(default_factory=lambda: [0])
    row_index: list[int] = field(default_factory=list)
    row_value: list[float] = field(default_factory=list)
    constant: float = 0.0
    # per column: whether a solver may leave it out until its reduced cost asks for it
    # (an edge's flow, passes/solve/column_generation.py)
    priced: list[bool] = field(default_factory=list)

    def column(self, binary: bool, priced: bool = False) -> int:
        """A new column, x >= 0 (and <= 1 when binary); its index."""
        self.priced.append(priced)
        self.cost.append(0.0)
        self.lower.append(0.0)
        self.upper.append(1.0 if binary else float("inf"))
        self.binary.append(binary)
        return len(self.cost) - 1

    def fix_zero(self, col: int) -> None:
        self.upper[col] = 0.0

    def row(self, coef: Mapping[int, float], lower: float, upper: float) -> None:
        """lower <= sum_j coef[j] x_j <= upper."""
        self.row_index.extend(coef)
        self.row_value.extend(coef.values())
        self.row_start.append(len(self.row_index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    def minimise(self, coef: Mapping[int, float], constant: float = 0.0) -> None:
        self.cost = [0.0] * len(self.cost)
        for j, c in coef.items():
            self.cost[j] = c
        self.constant = constant

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)


class SolveStatus(Enum):
    OPTIMAL = "Optimal"
    FEASIBLE = "Feasible"  # a limit stopped the search with a solution in hand
    INFEASIBLE = "Infeasible"
    NOT_SOLVED = "Not Solved"


@dataclass(frozen=True)
class Solution:
    status: SolveStatus
    values: tuple[float, ...]  # per column (zeros without a solution)
    objective: float
    gap: Optional[float]  # relative MIP gap where the solver reports one
    seconds: float
    # a proven lower bound on the objective (HiGHS's dual bound; CBC's optimum when it
    # proves one); None where the solver proved none
    bound: Optional[float] = None


Start = tuple[np.ndarray, np.ndarray]  # a first solution: int32 columns, float64 values


def solver_name(options: Options) -> str:
    """"highs" or "cbc" for Options.solver ("auto": HiGHS when highspy is installed)."""
    if options.solver in (SolverChoice.AUTO, SolverChoice.HIGHS) and highspy is not None:
        return "highs"
    if options.solver is SolverChoice.HIGHS:
        raise SolverError("Options(solver='highs') but highspy is not installed; pip install highspy "
                          "or use solver='cbc'")
    return "cbc"


def solve_program(program: LinearProgram, options: Options, start: Optional[Start] = None) -> Solution:
    """Solve with the solver Options picks, within Options.time_limit_s, to Options.mip_gap. `start`: a first
    solution, (columns, values), the solver completing the columns not given
    (passes/solve/warm_start.py); HiGHS only (CBC starts from nothing)."""
    name = solver_name(options)
    t0 = time.perf_counter()
    if name == "highs":
        status, values, objective, gap, bound = _run_highs(program, options.time_limit_s, start, options.mip_gap)
    else:
        status, values, objective, gap, bound = _run_cbc(program, options.time_limit_s, options.mip_gap)
    return Solution(status, values, objective, gap, time.perf_counter() - t0, bound)


# HiGHS's feasibility-jump heuristic searches for a first plan before the root LP; the
# root LP of these ILPs is (near) integral and finds the optimum itself, so the jump is
# a quarter of the solve spent for nothing (hrm_text (2,4): 4.2 s instead of 5.0 s;
# gemma3_text 0.28 s instead of 0.37 s; same optimum). One thread: the solve is a branch
# and bound that the root LP settles; HiGHS's worker threads only spin beside it, and on
# a loaded 2-core machine they cost more than they give (hrm_text, machine busy: 28 s
# wall with its default threads, 18 s with one; kimi_linear 19 s and 8 s; same optimum).
# No presolve: it finds little to remove (the x flows are already merged per class and
# pruned, passes/solve/ilp.py and dominance.py) and costs more than it saves, twice the solve on
# every model tried (kimi_linear (2, 4) 7.3-10.0 s with it, 3.9-4.1 s without; hrm_text
# 9.7-11.1 and 6.8-7.0; funnel 5.5 and 2.9; t5gemma 3.2 and 1.4; llama 0.9 and 0.4; same
# optimum every time).
EXTRA_HIGHS_OPTIONS = {"mip_heuristic_run_feasibility_jump": False, "threads": 1, "presolve": "off"}


Outcome = tuple[SolveStatus, tuple[float, ...], float, Optional[float], Optional[float]]  # + gap, bound


def _run_highs(p: LinearProgram, time_limit_s: float, start: Optional[Start] = None, gap: float = 1e-4) -> Outcome:
    h = quiet_highs()
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", float(gap))
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(p.cost), p.num_rows
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = np.array(p.cost), np.array(p.lower), np.array(p.upper)
    lp.row_lower_, lp.row_upper_ = np.array(p.row_lower), np.array(p.row_upper)
    lp.offset_ = p.constant
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = len(p.cost), p.num_rows
    lp.a_matrix_.start_ = np.array(p.row_start, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(p.row_index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(p.row_value)
    kinds = highspy.HighsVarType
    lp.integrality_ = [kinds.kInteger if b else kinds.kContinuous for b in p.binary]
    h.passModel(lp)
    if start is not None and len(start[0]):  # HiGHS completes it (or drops it where it cannot) before its search
        try:
            h.setSolution(len(start[0]), start[0], start[1])
        except TypeError:  # highspy before 1.8 takes whole solutions only: no start
            pass
    h.run()
    return highs_outcome(h, len(p.cost), any(p.binary))


def highs_outcome(h, columns: int, mip: bool) -> Outcome:
    """What HiGHS's last run of `h` found: status, every column's value, objective, gap and
    proven bound (a MIP's dual bound; an LP's optimum is its own bound)."""
    model_status = h.getModelStatus()
    codes = highspy.HighsModelStatus
    info = h.getInfo()
    solved = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    if model_status == codes.kOptimal:
        status = SolveStatus.OPTIMAL
    elif model_status in (codes.kInfeasible, codes.kUnboundedOrInfeasible):
        status = SolveStatus.INFEASIBLE
    else:
        status = SolveStatus.FEASIBLE if solved else SolveStatus.NOT_SOLVED
    if status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        values = tuple(h.getSolution().col_value)
        if mip:
            bound: Optional[float] = float(info.mip_dual_bound)
        else:  # an LP: its optimum is its own bound
            bound = info.objective_function_value if status is SolveStatus.OPTIMAL else None
        if bound is not None and not math.isfinite(bound):  # stopped before the root LP settled
            bound = None
        return status, values, info.objective_function_value, float(info.mip_gap), bound
    return status, (0.0,) * columns, 0.0, None, None


@cache
def _highs_options() -> dict[str, object]:
    """EXTRA_HIGHS_OPTIONS that this HiGHS knows (older ones lack some)."""
    probe = _highs_base()()
    probe.setOptionValue("output_flag", False)
    return {k: v for k, v in EXTRA_HIGHS_OPTIONS.items() if probe.getOptionType(k)[0] == highspy.HighsStatus.kOk}


def _highs_base():
    """highspy's base class: highspy.Highs() logs (and so prints HiGHS's banner, from C,
    once per process) while it is made, before its output can be turned off."""
    return getattr(getattr(highspy, "_core", None), "_Highs", None) or highspy.Highs


def quiet_highs():
    h = _highs_base()()
    h.setOptionValue("output_flag", False)
    for k, v in _highs_options().items():
        h.setOptionValue(k, v)
    return h


def _run_cbc(p: LinearProgram, time_limit_s: float, gap: float = 1e-4) -> Outcome:
    """The fallback: the same program through PuLP's bundled CBC."""
    import pulp
    prob = pulp.LpProblem("autopar_sharding", pulp.LpMinimize)
    width = len(str(len(p.cost)))
    cols = [_pulp_variable(prob, f"x{j:0{width}d}", lowBound=lo, upBound=None if up == float("inf") else up,
                           cat="Binary" if b and up > 0 else "Continuous")
            for j, (lo, up, b) in enumerate(zip(p.lower, p.upper, p.binary))]
    for r in range(p.num_rows):
        lo, up = p.row_lower[r], p.row_upper[r]
        span = range(p.row_start[r], p.row_start[r + 1])
        expr = pulp.LpAffineExpression({cols[p.row_index[k]]: p.row_value[k] for k in span})
        sense, rhs = ((pulp.LpConstraintEQ, lo) if lo == up else
                      (pulp.LpConstraintLE, up) if lo == -float("inf") else (pulp.LpConstraintGE, lo))
        prob.addConstraint(pulp.LpConstraint(expr, sense, rhs=rhs), f"r{r}")
    prob += pulp.LpAffineExpression({cols[j]: c for j, c in enumerate(p.cost) if c}, constant=p.constant)
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=1, gapRel=gap))
    text = pulp.LpStatus[prob.status]
    status = {"Optimal": SolveStatus.OPTIMAL, "Infeasible": SolveStatus.INFEASIBLE}.get(text, SolveStatus.NOT_SOLVED)
    values = tuple((c.value() or 0.0) for c in cols)
    objective = pulp.value(prob.objective) or 0.0
    # PuLP reports "Optimal" for a solution CBC found before its time limit too: only a
    # proven optimum (sol_status) is a bound
    proven = getattr(prob, "sol_status", None) == getattr(pulp, "LpSolutionOptimal", object())
    return status, values, objective, None, objective if status is SolveStatus.OPTIMAL and proven else None


def _pulp_variable(prob, name: str, **kw):
    """PuLP 3.3 deprecates free-standing LpVariable in favour of prob.add_variable."""
    import pulp
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, **kw)
    return pulp.LpVariable(name, **kw)
