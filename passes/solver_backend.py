"""The ILP solver behind passes/solve.py: HiGHS through highspy when installed (several
times faster on these problems), PuLP's bundled CBC otherwise.

Both run with their own output off (msg=False: HiGHS's output_flag, CBC's log), so a
solve leaves the process's stdout alone: no file descriptor is redirected, and another
thread printing during a solve is still heard."""

from __future__ import annotations

import time
from functools import cache
from typing import Optional

import pulp

from autopar.core.errors import SolverError
from autopar.core.options import Options

try:
    import highspy
except ImportError:  # optional: without it the solver is CBC
    highspy = None


def solver_for(options: Options) -> tuple[str, pulp.LpSolver]:
    highs = pulp.HiGHS(msg=False, timeLimit=options.time_limit_s, **_highs_options())
    if options.solver in ("auto", "highs") and highs.available():
        return "highs", highs
    if options.solver == "highs":
        raise SolverError("Options(solver='highs') but highspy is not installed; pip install highspy "
                          "or use solver='cbc'")
    return "cbc", pulp.PULP_CBC_CMD(msg=False, timeLimit=options.time_limit_s, threads=1)


# HiGHS's feasibility-jump heuristic searches for a first plan before the root LP; the
# root LP of these ILPs is (near) integral and finds the optimum itself, so the jump is
# a quarter of the solve spent for nothing (hrm_text (2,4): 4.2 s instead of 5.0 s;
# gemma3_text 0.28 s instead of 0.37 s; same optimum). Branch and bound is unchanged.
# One thread: the solve is a branch and bound whose root LP settles it; HiGHS's worker
# threads only spin beside it, and on a loaded 2-core machine they cost more than they
# give (hrm_text (2, 4), machine busy: 28 s wall with its default threads, 18 s with one;
# kimi_linear 19 s and 8 s; same optimum).
EXTRA_HIGHS_OPTIONS = {"mip_heuristic_run_feasibility_jump": False, "threads": 1}


@cache
def _highs_options() -> dict[str, object]:
    """EXTRA_HIGHS_OPTIONS that this HiGHS knows (older ones lack some)."""
    base = getattr(getattr(highspy, "_core", None), "_Highs", None)
    if base is None:
        return {}
    probe = base()
    probe.setOptionValue("output_flag", False)
    return {k: v for k, v in EXTRA_HIGHS_OPTIONS.items() if probe.getOptionType(k)[0] == highspy.HighsStatus.kOk}


def solve_quietly(prob: pulp.LpProblem, solver: pulp.LpSolver) -> float:
    """Solves `prob` in place; returns the seconds it took."""
    if isinstance(solver, pulp.HiGHS):
        _spend_highs_banner()
    t0 = time.perf_counter()
    prob.solve(solver)
    return time.perf_counter() - t0


@cache
def _spend_highs_banner() -> None:
    """HiGHS prints its banner once per process, from C, the first time a Highs object
    logs with output_flag on, which highspy's Highs() does on construction, before PuLP
    can pass msg=False. Spend that banner here, on a Highs object that logs nowhere.
    highspy's base class is used because its Highs() would print while being made."""
    base = getattr(getattr(highspy, "_core", None), "_Highs", None)
    if base is None:  # no highspy, or one laid out otherwise: at worst the banner shows
        return
    silent = base()
    silent.setOptionValue("log_to_console", False)
    silent.passModel(highspy.HighsLp())  # logs the header, to nowhere


def gap(prob: pulp.LpProblem) -> Optional[float]:
    model = getattr(prob, "solverModel", None)
    try:
        return float(model.getInfo().mip_gap)
    except Exception:  # noqa: BLE001 - the gap is informational; CBC through pulp does not expose it
        return None
