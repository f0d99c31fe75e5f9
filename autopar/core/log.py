"""autopar's `logging` logger ("autopar"): quiet by default (a library adds no handler),
so an application's own logging configuration decides. AUTOPAR_LOG=info (or debug,
warning) in the environment attaches one stderr handler at that level when the package
loads, for a quick look at what planning does:

    autopar: trace: 2.31 s (GPT2LMHeadModel, 1203 nodes)
    autopar: strategies: 0.84 s (1203 nodes, 5120 strategies)
    autopar: solve: 1.02 s (Optimal, 24412 variables, step 13.626 ms predicted)

Stages decorated with `logged` report their wall time and a one-line description of
what they made, and while one runs longer than HEARTBEAT_S it says so every HEARTBEAT_S
("autopar: solve: still running, 10 s"), so a long solve is never silent; the runtime
says once per new input signature that it plans again.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator

LOG = logging.getLogger("autopar")
HEARTBEAT_S = 5.0  # a stage running longer than this says so, this often
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def configure_from_env() -> None:
    """AUTOPAR_LOG=<level>: one stderr handler on the autopar logger (once)."""
    level = LEVELS.get(os.environ.get("AUTOPAR_LOG", "").strip().lower())
    if level is None or any(getattr(h, "_autopar_env", False) for h in LOG.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("autopar: %(message)s"))
    handler._autopar_env = True  # type: ignore[attr-defined]
    LOG.addHandler(handler)
    LOG.setLevel(level)


def logged(stage: str, describe: Callable[[Any], str], level: int = logging.INFO) -> Callable:
    """Decorate a stage function: at `level`, log '<stage>: <seconds> s (<describe(result)>)',
    and '<stage>: still running, <seconds> s' every HEARTBEAT_S until it returns."""
    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not LOG.isEnabledFor(level):
                return fn(*args, **kwargs)
            start = time.perf_counter()
            with _heartbeat(stage, level, start):
                out = fn(*args, **kwargs)
            LOG.log(level, "%s: %.2f s (%s)", stage, time.perf_counter() - start, describe(out))
            return out
        return run
    return wrap


@contextlib.contextmanager
def _heartbeat(stage: str, level: int, start: float) -> Iterator[None]:
    """A daemon thread that logs the stage's running time every HEARTBEAT_S until the block ends."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            LOG.log(level, "%s: still running, %.0f s", stage, time.perf_counter() - start)

    thread = threading.Thread(target=beat, name=f"autopar-{stage}-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
