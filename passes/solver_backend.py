"""The ILP solver behind passes/solve.py: HiGHS through highspy when installed (several
times faster on these problems), PuLP's bundled CBC otherwise."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

import pulp

from autopar.core.errors import SolverError
from autopar.core.options import Options


def solver_for(options: Options):
    highs = pulp.HiGHS(msg=False, timeLimit=options.time_limit_s)
    if options.solver in ("auto", "highs") and highs.available():
        return "highs", highs
    if options.solver == "highs":
        raise SolverError("Options(solver='highs') but highspy is not installed; pip install highspy "
                          "or use solver='cbc'")
    return "cbc", pulp.PULP_CBC_CMD(msg=False, timeLimit=options.time_limit_s, threads=1)


@contextlib.contextmanager
def quiet_stdout():
    """HiGHS prints a banner from C even with msg=False; keep the user's stdout clean."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)


def gap(prob) -> Optional[float]:
    model = getattr(prob, "solverModel", None)
    try:
        return float(model.getInfo().mip_gap)
    except Exception:  # noqa: BLE001 - the gap is informational; CBC through pulp does not expose it
        return None
