"""Every call's inputs agreed between ranks: ranks that disagree at a later call raise at
once on every rank, naming each rank's shapes, instead of hanging in a collective."""

from __future__ import annotations

import pytest
import torch

from tests import cases
from tests.harness import run_ranks


@pytest.mark.parametrize("both_planned", [False, True], ids=["one-rank-plans", "both-hold-programs"])
def test_ranks_passing_other_shapes_at_the_third_call_raise_on_every_rank_within_seconds(both_planned):
    results = run_ranks(2, [(cases.inputs_differ_later, dict(call=3, both_planned=both_planned))])
    for rank, (res,) in enumerate(results):
        assert res["caught"] is not None, f"rank {rank} ran the mismatched call"
        kind, message = res["caught"]
        assert kind == "InputMismatchError", (rank, kind, message)
        assert "call 3" in message and "rank 0: args[0] [4, 16] float32" in message, message
        assert "rank 1: args[0] [3, 16] float32" in message, message
        assert "drop_last=True" in message, message
        # the collective timeout is 120 s: this is the agreement, not a timeout
        assert res["seconds"] < 30, (rank, res["seconds"])
        # the group stays usable: the next call with the same inputs runs and matches
        parallel, reference = res["after"]
        torch.testing.assert_close(parallel, reference)
        assert res["plans"] == (2 if both_planned else 1)  # the refused call planned nothing


def test_the_agreement_settles_before_the_first_collective_and_once():
    """settled_before_first_collective: settle() runs when the program launches its first
    collective (not before: the compute up to it overlaps the agreement), exactly once,
    and on leaving where the program launched none."""
    from autopar.core.kinds import StepKind
    from autopar.runtime.collectives import AxisComm, Move, finish, launch, settled_before_first_collective

    events: list[str] = []
    comm = AxisComm.standing_in(2)
    x = torch.ones(4, 3)
    with settled_before_first_collective(lambda: events.append("settled")):
        events.append("compute")
        started = launch(Move(StepKind.ALL_REDUCE), x, comm)
        events.append("launched")
        finish(Move(StepKind.ALL_REDUCE), started, comm)
        launch(Move(StepKind.ALL_GATHER, dim=0, size=4), x, comm)
    assert events == ["compute", "settled", "launched"], events

    events.clear()
    with settled_before_first_collective(lambda: events.append("settled")):
        events.append("compute")
    assert events == ["compute", "settled"], events

    def refuse() -> None:
        raise RuntimeError("ranks differ")
    with pytest.raises(RuntimeError, match="ranks differ"):
        with settled_before_first_collective(refuse):
            launch(Move(StepKind.ALL_REDUCE), x, comm)
    launch(Move(StepKind.ALL_REDUCE), x, comm)  # settled once: a later collective runs nothing

    events.clear()  # a call inside a call: the outer agreement settles before the inner one starts
    with settled_before_first_collective(lambda: events.append("outer")):
        with settled_before_first_collective(lambda: events.append("inner")):
            launch(Move(StepKind.ALL_REDUCE), x, comm)
    assert events == ["outer", "inner"], events
