"""A plan checked in the in-process mesh simulator (passes/simulate_mesh.py) against the
single-device model: every simulated rank's outputs and, in training, every local
parameter gradient, at torch.testing.assert_close's fp32 defaults.

    assert_simulation_matches(model, args, kwargs, traced, plan, context="gpt2-tiny")

The simulator runs all ranks' programs in lockstep in one process (seconds, no spawn);
real gloo ranks check the runtime itself (tests/harness.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from autopar import _compat
from autopar.core.kinds import NodeKind
from autopar.core.placement import local_chunk
from autopar.passes.simulate_mesh import simulate
from autopar.passes.trace import flatten_inputs


def loss_of(out: Any) -> torch.Tensor:
    """The scalar a test differentiates: the model's own loss where it returns one, else
    the mean square of its first output."""
    if isinstance(out, torch.Tensor):
        return (out.float() ** 2).mean()
    loss = getattr(out, "loss", None)
    return loss if loss is not None else (out[0].float() ** 2).mean()


def tensor_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in _compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def assert_simulation_matches(model: torch.nn.Module, args: tuple, kwargs: dict, traced, plan,
                              context: str = "") -> int:
    """Assert every simulated rank matches the single-device model (gradients too when
    `traced.training`); returns how many parameter gradients were compared per rank."""
    # 1. the single-device reference, on a copy (the simulator reads `model`'s tensors)
    ref = copy.deepcopy(model)
    with torch.set_grad_enabled(traced.training):
        ref_out = ref(*args, **kwargs)
        if traced.training:
            loss_of(ref_out).backward()
    want = [t.detach() for t in tensor_leaves(ref_out)]
    # 2. every rank's program, run in lockstep on its shards of the same tensors
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    with torch.set_grad_enabled(traced.training):
        outs, leaves = simulate(traced, plan, state, flatten_inputs(args, kwargs)[0])
        if traced.training:  # each rank differentiates its own (replicated) loss, as on real ranks
            torch.autograd.backward([loss_of(_compat.tree_unflatten(o, traced.out_spec)) for o in outs])
    # 3. outputs, then each rank's gradient block against the matching block of the full one
    for r, got in enumerate(outs):
        assert len(got) == len(want) > 0, f"rank {r}, {context}: {len(got)} outputs, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g.detach(), w, msg=lambda m: f"rank {r} output {i}, {context}: {m}")
    if not traced.training:
        return 0
    ref_grads = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False)}
    used = {e.producer for e in plan.edges}
    params = [gi for gi in traced.inputs if gi.kind == NodeKind.PARAMETER and gi.name in used]
    for r in range(plan.mesh.size):
        coords = plan.mesh.coords(r)
        for gi in params:
            spec = plan.node(gi.name).outputs[0]
            got, full = leaves[r][gi.target].grad, ref_grads[gi.target]
            if full is None:
                assert got is None or not got.any(), f"rank {r}, {context}: {gi.target} has a gradient it should not"
                continue
            assert got is not None, f"rank {r}, {context}: {gi.target} ({spec}) got no gradient"
            torch.testing.assert_close(got, local_chunk(full, spec, plan.mesh.shape, coords),
                                       msg=lambda m: f"rank {r} grad of {gi.target} ({spec}), {context}: {m}")
    return len(params)
