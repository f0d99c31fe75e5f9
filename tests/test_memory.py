"""The memory budget: loose -> the fast plan; tight -> sharded parameters within the
budget; impossible -> a typed error with the numbers."""

from __future__ import annotations
from autopar.core.kinds import NodeKind

import warnings

import pytest
import torch

import autopar
from tests.models import MLP


def _plan(model, x, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopar.plan(model, (x,), mesh=(4, 1), **kw)


@pytest.fixture(scope="module")
def data_parallel_case():
    model = MLP((256, 1024, 256)).eval()
    x = torch.randn(4096, 256)
    free = _plan(model, x)
    return model, x, free


def test_unbounded_plan_is_data_parallel_with_replicated_weights(data_parallel_case):
    _, _, free = data_parallel_case
    params = [n for n in free.nodes if n.kind is NodeKind.PARAMETER]
    assert all(n.outputs[0].is_replicated() for n in params)


def test_loose_budget_changes_nothing(data_parallel_case):
    model, x, free = data_parallel_case
    loose = _plan(model, x, memory_budget_bytes=10 * free.memory_bytes)
    assert loose.placements() == free.placements() and loose.total_s == pytest.approx(free.total_s)


def test_tight_budget_shards_parameters_and_fits(data_parallel_case):
    model, x, free = data_parallel_case
    budget = free.memory_bytes - free.param_bytes // 2
    tight = _plan(model, x, memory_budget_bytes=budget)
    assert tight.memory_bytes <= budget
    assert tight.param_bytes < free.param_bytes
    assert any(not n.outputs[0].is_replicated() for n in tight.nodes if n.kind is NodeKind.PARAMETER)
    assert tight.total_s >= free.total_s  # memory is bought with time, never the reverse
    assert tight.solver.objective_s == pytest.approx(tight.total_s, rel=1e-6)


def test_training_counts_gradients_and_optimizer_state():
    model = MLP((256, 1024, 256)).train()
    plan = _plan(model, torch.randn(64, 256), training=True)
    params = [n for n in plan.nodes if n.kind is NodeKind.PARAMETER]
    local_elems = sum(n.outputs[0].local_nbytes((4, 1)) // 4 for n in params)
    assert plan.state_bytes == local_elems * (4 + 8)  # fp32 gradient + two fp32 AdamW states


def test_an_output_returned_whole_counts_whole_on_every_rank():
    """Training: a batch-split op's output gathered for the caller is a whole copy on each
    rank, live at the end of forward though backward keeps nothing of it: the plan counts
    it beside what backward keeps, and evaluate() agrees. In inference the op outputs
    already count (an upper bound) and the output node adds nothing."""
    from autopar.cost_models.evaluate import evaluate, op_target
    from autopar.cost_models.memory import node_bytes
    model, x = MLP((256, 1024, 256)).train(), torch.randn(4096, 256)
    plan = _plan(model, x, training=True)
    (out,) = [n for n in plan.nodes if n.kind is NodeKind.OUTPUT]
    whole = x.shape[0] * 256 * 4
    assert out.inputs[0].is_replicated() and out.inputs[0].local_nbytes((4, 1)) == whole
    last = plan.node(next(e.producer for e in plan.edges if e.consumer == out.name))
    assert not last.outputs[0].is_replicated()  # the op's own output is split, and not kept
    kept = sum(node_bytes(n.kind, op_target(n.op, n.name) if n.kind.computes else None, n.outputs, (4, 1), True, 0,
                          n.saved)
               for n in plan.nodes if not n.kind.is_state and n.kind is not NodeKind.OUTPUT)
    assert plan.activation_bytes == kept + whole
    assert evaluate(plan).memory_bytes == plan.memory_bytes
    inference = _plan(model.eval(), x)
    made = sum(n.outputs[0].local_nbytes((4, 1)) for n in inference.nodes if n.kind.computes or n.kind.is_input
               and not n.kind.is_state)
    assert inference.activation_bytes == made


def test_impossible_budget_names_budget_and_smallest_footprint(data_parallel_case):
    model, x, free = data_parallel_case
    with pytest.raises(autopar.MemoryBudgetError) as err:
        _plan(model, x, memory_budget_bytes=1000)
    e = err.value
    assert e.budget_bytes == 1000 and 1000 < e.smallest_bytes <= free.memory_bytes
    assert "1000 bytes" in str(e) and str(e.smallest_bytes) in str(e)
    # and the smallest footprint reported really is achievable
    assert _plan(model, x, memory_budget_bytes=e.smallest_bytes).memory_bytes <= e.smallest_bytes


def test_budget_plan_trains_correctly_in_simulation():
    """A tight-budget training plan (sharded storage, gathered at use) gives the same
    outputs and gradients as the single device on every simulated rank."""
    from autopar.core.mesh import Mesh
    from autopar.core.options import Options
    from autopar.passes.plan.planning import plan_traced
    from autopar.passes.trace.trace import trace
    from tests.test_fuzz import check_plan_simulated
    model = MLP((64, 256, 64)).train()
    x = torch.randn(256, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace(model, (x,))
        free = plan_traced(traced, Mesh((4, 1)), Options())[1]
        plan = plan_traced(traced, Mesh((4, 1)), Options(memory_budget_bytes=free.memory_bytes * 3 // 4))[1]
    assert plan.memory_bytes <= free.memory_bytes * 3 // 4
    check_plan_simulated(model, x, traced, plan)
