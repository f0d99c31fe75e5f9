"""No hangs: when one rank fails, the others raise within the timeout."""

from __future__ import annotations

import pytest

from tests import cases
from tests.harness import run_ranks

# one 4-rank spawn, waiting out a collective timeout on purpose (8 s); the quick set runs
# real ranks in test_fuzz, test_training and test_runtime
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    # verify first: the failures after it leave the process group unusable for more cases
    return run_ranks(4, [(cases.verify_plans, dict(mesh=(2, 2))),
                         (cases.one_rank_fails, dict(where="compile")),
                         (cases.one_rank_fails, dict(where="step", timeout_s=8.0,
                                                     done_dir=str(tmp_path_factory.mktemp("raised"))))])


def test_a_failing_rank_never_hangs_the_others(four_ranks):
    results = [r[1:] for r in four_ranks]
    compile_fail = [r[0] for r in results]
    # rank 1 traced other shapes: every rank fails at the start-up check, at once
    for rank, res in enumerate(compile_fail):
        assert res["caught"], f"rank {rank} did not fail: {res}"
        assert res["seconds"] < 60, res
        assert "rank 1" in res["caught"] or "fingerprint" in res["caught"], res
    step_fail = [r[1] for r in results]
    assert "raised_on_purpose" in step_fail[1]
    for rank, res in enumerate(step_fail):
        if rank == 1:
            continue
        # every other rank waits in a collective rank 1 never joins: each must raise once
        # the 8 s collective timeout passes (well before rank 1 wakes up at 24 s)
        assert res["caught"], (rank, res)
        assert 8.0 <= res["seconds"] < 24.0, (rank, res)


def test_verify_passes_a_correct_plan_and_names_a_corrupted_one(four_ranks):
    for rank, res in enumerate(r[0] for r in four_ranks):
        good, bad = res["good"], res["bad"]
        assert good.ok, f"rank {rank}: {good}"
        assert good.outputs and good.gradients and good.layers
        assert not bad.ok
        producer, consumer = res["victim"]
        # the first tensor that differs is the one the removed all-reduce should have produced
        expected = "output[0]" if consumer == "output" else consumer
        assert bad.first_mismatch == expected, (rank, str(bad), res["victim"])
        assert "MISMATCH" in str(bad) and expected in str(bad)


def test_a_rank_killed_by_a_signal_reports_native_frames_of_every_thread(tmp_path):
    # what a rank that dies in C++ leaves in the log: Python frames (faulthandler), then
    # c10's native frames of each thread (how the gloo heap corruption of
    # docs/how-it-works.md was traced to gloo's worker threads)
    from torch.multiprocessing import ProcessExitedException
    log = tmp_path / "rank0.err"
    with pytest.raises(ProcessExitedException, match="SIGSEGV"):
        run_ranks(2, [(cases.crash_natively, dict(log=str(log)))])
    err = log.read_text()
    assert "Fatal Python error: Segmentation fault" in err and "crash_natively" in err, err[-3000:]
    assert "SIGSEGV(11)" in err and "frame #" in err and err.count(", Thread ") >= 2, err[-3000:]
