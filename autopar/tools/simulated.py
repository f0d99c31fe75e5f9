"""A plan checked in the in-process mesh simulator (passes/lower/simulate_mesh.py) against the
single-device model: every simulated rank's outputs, its block of every buffer the
model writes (BatchNorm's running statistics) and, in training, every local parameter
gradient, at torch.testing.assert_close's fp32 defaults.

    ref = reference_run(model, args, kwargs, training=True)
    compared = simulate_against(model, args, kwargs, traced, plan, ref, context="gpt2-tiny")
    simulate_sgd_steps(model, [(args, kwargs)] * 2, traced, plan, lr=0.1)  # state carried over

The simulator runs all ranks' programs in lockstep in one process (seconds, no spawn);
the sweep and the test suite use it for breadth, real gloo ranks check the runtime.
A mismatch raises AssertionError naming the rank, the output or parameter, its spec and
the differences (torch.testing's message)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from autopar import _compat
from autopar.core.kinds import NodeKind
from autopar.core.placement import block_index, local_chunk
from autopar.cost_models.devices import DeviceSpec, Link
from autopar.passes.lower.simulate_mesh import simulate
from autopar.passes.trace.trace import flatten_inputs

# nearly free communication and dear compute: the solver shards all its rules allow, so
# a check in the simulator (or on ranks) exercises sharded programs, not replicas
CHEAP_COMM = DeviceSpec("cheap-comm", {torch.float32: 1e9}, mem_bw_bytes_per_s=1e9, op_overhead_s=0.0,
                        intra_link=Link(1e-9, 1e-15), inter_link=Link(1e-9, 1e-15), achievable=1.0)


def loss_of(out: Any) -> torch.Tensor:
    """The scalar a check differentiates: the model's own loss where it returns one, else
    the mean square of its first output."""
    if isinstance(out, torch.Tensor):
        return (out.float() ** 2).mean()
    loss = getattr(out, "loss", None)
    return loss if loss is not None else (out[0].float() ** 2).mean()


def tensor_leaves(out: Any) -> list[torch.Tensor]:
    return [t for t in _compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


@dataclass(frozen=True)
class Reference:
    """What one device computed: the output leaves, in training each parameter's
    gradient by state-dict key (None where it got none), and every buffer after the call
    (the model's in-place updates done)."""

    outputs: tuple[torch.Tensor, ...]
    grads: dict[str, Optional[torch.Tensor]]
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


def reference_run(model: torch.nn.Module, args: tuple, kwargs: dict, training: bool) -> Reference:
    """The single-device run, on a copy (the simulator reads `model`'s own tensors)."""
    return _reference_step(copy.deepcopy(model), args, kwargs, training)


def _reference_step(ref: torch.nn.Module, args: tuple, kwargs: dict, training: bool) -> Reference:
    with torch.set_grad_enabled(training):
        out = ref(*args, **kwargs)
        if training:
            loss_of(out).backward()
    grads = {k: p.grad for k, p in ref.named_parameters(remove_duplicate=False)} if training else {}
    buffers = {k: b.detach().clone() for k, b in ref.named_buffers(remove_duplicate=False)}
    return Reference(tuple(t.detach() for t in tensor_leaves(out)), grads, buffers)


def simulate_against(model: torch.nn.Module, args: tuple, kwargs: dict, traced, plan,
                     ref: Optional[Reference] = None, context: str = "") -> int:
    """Run every rank's program of `plan` in the simulator on `model`'s tensors and assert
    each matches `ref` (run here when not given); returns how many parameter gradients
    were compared per rank (0 in inference)."""
    ref = ref if ref is not None else reference_run(model, args, kwargs, traced.training)
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    return _simulated_step(state, args, kwargs, traced, plan, ref, context)[0]


def _simulated_step(state: dict, args: tuple, kwargs: dict, traced, plan, ref: Reference,
                    context: str) -> tuple[int, list, list]:
    """One simulated call from full `state`, checked against `ref`: (gradients compared
    per rank, each rank's parameter leaves, each rank's new buffer blocks)."""
    with torch.set_grad_enabled(traced.training):
        outs, leaves, buffers = simulate(traced, plan, state, flatten_inputs(args, kwargs)[0])
        if traced.training:  # each rank differentiates its own (replicated) loss, as on real ranks
            torch.autograd.backward([loss_of(_compat.tree_unflatten(o, traced.out_spec)) for o in outs])
    where = f", {context}" if context else ""
    _assert_outputs(outs, ref, where)
    _assert_buffers(buffers, traced, plan, ref, where)
    compared = _assert_gradients(leaves, traced, plan, ref, where) if traced.training else 0
    return compared, leaves, buffers


def simulate_sgd_steps(model: torch.nn.Module, batches: list[tuple[tuple, dict]], traced, plan,
                       lr: float = 0.1, context: str = "") -> int:
    """Plain SGD steps in the simulator and on a copy of `model`, each checked as
    simulate_against checks one call. Between steps the simulated state is put together
    from the ranks' blocks (new buffers, parameters moved by their local gradients), so
    a later step starts from what the ranks hold, not from the reference's state.
    `model` itself is left as it was; returns the number of steps checked."""
    ref_model = copy.deepcopy(model)
    state = {k: t.detach().clone().requires_grad_(t.requires_grad)
             for k, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    for step, (args, kwargs) in enumerate(batches):
        ref = _reference_step(ref_model, args, kwargs, traced.training)
        _, leaves, buffers = _simulated_step(state, args, kwargs, traced, plan, ref, f"{context} step {step + 1}")
        state = _next_state(state, leaves, buffers, traced, plan, lr)
        with torch.no_grad():
            for p in ref_model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        ref_model.zero_grad(set_to_none=True)
    return len(batches)


def _next_state(state: dict, leaves: list, buffers: list, traced, plan, lr: float) -> dict:
    """The full state after an SGD step, put together from every rank's block: each
    parameter minus lr times its gradient, each written buffer its new value."""
    mesh = plan.mesh
    new = {k: t.detach().clone() for k, t in state.items()}
    for gi in traced.inputs:
        if not gi.kind.is_state:
            continue
        spec = plan.node(gi.name).outputs[0]
        for r in range(mesh.size):
            index = block_index(spec, mesh.shape, mesh.coords(r))
            if gi.target in buffers[r]:
                new[gi.target][index] = buffers[r][gi.target]
            grad = leaves[r][gi.target].grad if gi.kind is NodeKind.PARAMETER else None
            if grad is not None:
                new[gi.target][index] = state[gi.target].detach()[index] - lr * grad
    return {k: t.requires_grad_(state[k].requires_grad) for k, t in new.items()}


def _assert_outputs(outs: list, ref: Reference, where: str) -> None:
    for r, got in enumerate(outs):
        assert len(got) == len(ref.outputs) > 0, f"rank {r}{where}: {len(got)} outputs, expected {len(ref.outputs)}"
        for i, (g, w) in enumerate(zip(got, ref.outputs)):
            torch.testing.assert_close(g.detach(), w, msg=lambda m: f"rank {r} output {i}{where}: {m}")


def _assert_buffers(buffers: list, traced, plan, ref: Reference, where: str) -> None:
    """Each rank's new block of each buffer the model writes against the matching block
    of the buffer after the single-device call."""
    for r in range(plan.mesh.size):
        coords = plan.mesh.coords(r)
        for u in traced.buffer_updates:
            spec = plan.node(u.placeholder).outputs[0]
            torch.testing.assert_close(buffers[r][u.target], local_chunk(ref.buffers[u.target], spec, plan.mesh.shape,
                                                                         coords),
                                       msg=lambda m: f"rank {r} buffer {u.target} ({spec}){where}: {m}")


def _assert_gradients(leaves: list, traced, plan, ref: Reference, where: str) -> int:
    """Each rank's gradient of each parameter the program reads against the matching block
    of the full gradient under the parameter's spec."""
    used = {e.producer for e in plan.edges}
    params = [gi for gi in traced.inputs if gi.kind == NodeKind.PARAMETER and gi.name in used]
    for r in range(plan.mesh.size):
        coords = plan.mesh.coords(r)
        for gi in params:
            spec = plan.node(gi.name).outputs[0]
            got, full = leaves[r][gi.target].grad, ref.grads.get(gi.target)
            if full is None:
                assert got is None or not got.any(), f"rank {r}{where}: {gi.target} has a gradient it should not"
                continue
            assert got is not None, f"rank {r}{where}: {gi.target} ({spec}) got no gradient"
            torch.testing.assert_close(got, local_chunk(full, spec, plan.mesh.shape, coords),
                                       msg=lambda m: f"rank {r} grad of {gi.target} ({spec}){where}: {m}")
    return len(params)
