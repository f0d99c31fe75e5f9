"""A finished job takes its process groups down before the interpreter ends
(autopar/runtime/teardown.py): two plain gloo processes that compile, train a step and
return without destroy_process_group exit 0, with every group destroyed by autopar's
exit hook and every gloo worker thread asleep (checked by an exit handler that runs
after it). How often a job aborts at exit without the hook is counted by
bench/soak.py and the README's figures, not here: one run proves nothing."""

from __future__ import annotations

import pytest

import sys
import tempfile

from tests.harness import plain_env, run_processes

SCRIPT = """
import atexit, sys
from datetime import timedelta
import torch, torch.distributed as dist
rank, store = int(sys.argv[1]), sys.argv[2]
# registered before autopar's hook, so it runs after it (atexit runs last-in first-out)
def after_autopar():
    from autopar.runtime.teardown import GLOO_WORKER, _thread_states
    states = _thread_states(GLOO_WORKER)
    print("initialised at exit:", dist.is_initialized(), "workers asleep:", states is None or set(states) <= {"S"},
          flush=True)
atexit.register(after_autopar)
import autopar
from autopar.tools.simulated import CHEAP_COMM
from tests.models import build
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=120))
model = build("mlp").train()
pm = autopar.compile(model, mesh=(2,), device=CHEAP_COMM)
pm(torch.randn(4, 16)).sum().backward()
state = pm.full_state_dict()
print("trained", sorted(state)[:1], flush=True)
"""


@pytest.mark.slow  # subprocesses or gloo ranks: in the full suite, out of the fast set
def test_a_job_that_never_destroys_its_groups_exits_0_with_them_taken_down():
    with tempfile.TemporaryDirectory() as tmp:
        ended = run_processes([[sys.executable, "-c", SCRIPT, str(rank), f"{tmp}/store"] for rank in range(2)],
                              [plain_env()] * 2, timeout_s=300)
    for rank, (code, log) in enumerate(ended):
        assert code == 0, f"rank {rank} exited {code}:\n{log[-3000:]}"
        assert "trained" in log and "initialised at exit: False workers asleep: True" in log, log[-3000:]
