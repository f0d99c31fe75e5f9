"""User-defined torch.autograd.Functions met while tracing for training.

torch.export (non-strict) runs a custom Function's `forward` and records its ops; its
own `backward` is not in the exported graph, so a training trace differentiates the
recorded forward instead. That is harmless where the backward is the forward's
derivative written by hand (BLOOM's GeLU, for speed), and wrong where it is not:
straight-through estimators, YOSO's approximate attention gradient, Reformer's
reversible layers (whose forward runs under no_grad and whose backward recomputes).

So each Function applied with gradients on is recorded with the shapes and dtypes of its
inputs, and after the export checked on random inputs of those shapes inside the usual
domains (floats in (0.25, 0.75): sqrt, log, acos are defined and smooth there): its own
backward against autograd through its forward, for one random output gradient. trace
refuses a training trace when they differ (or the check cannot run, or meets a value
that is not finite), naming the
Functions; inference is always exact (the forward is what one device runs)."""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from autopar import _compat

MAX_CHECK_ELEMENTS = 1 << 22  # a Function whose inputs are larger is not checked (a warning says so)


@dataclass(frozen=True)
class TensorShape:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class Applied:
    """One user-defined Function as applied while tracing: its class and its arguments,
    tensors kept as their shapes."""

    cls: type
    args: tuple
    kwargs: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"


@contextmanager
def custom_functions_applied() -> Iterator[list[Applied]]:
    """While the block runs, the first application of each user-defined autograd.Function
    with gradients enabled is appended to the yielded list (torch's own, under `torch.`,
    are left out)."""
    seen: list[Applied] = []
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if torch.is_grad_enabled() and not cls.__module__.startswith("torch.") and \
                not any(a.cls is cls for a in seen):
            seen.append(Applied(cls, tuple(_shape_of(a) for a in args), dict(kwargs)))
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = original


def backward_differs(applied: Applied) -> bool:
    """True when the Function's own backward is not the derivative of its forward on
    random inputs (or the comparison cannot be made)."""
    elements = sum(math.prod(a.shape) for a in applied.args if isinstance(a, TensorShape))
    if elements > MAX_CHECK_ELEMENTS:
        warnings.warn(f"custom autograd.Function {applied.name}: inputs too large ({elements} elements) to check "
                      "that its backward is its forward's derivative; the trace differentiates its forward")
        return False
    try:
        own, derived = _both_gradients(applied)
    except Exception:  # noqa: BLE001 - a Function that cannot be checked is not trusted
        return True
    if not all(torch.isfinite(t).all() for t in own + derived):
        return True  # outside the Function's domain on these inputs: nothing shows the two agree
    return not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(own, derived))


def _both_gradients(applied: Applied) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    args = tuple(_example(a, g) for a in applied.args)
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    with torch.enable_grad():
        own_out = _tensor_outputs(applied.cls.apply(*args, **applied.kwargs))
        seeds = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in own_out]
        own = torch.autograd.grad(own_out, wrt, seeds, allow_unused=True)
    derived = _forward_vjp(applied, args, wrt, seeds)
    zeros = [torch.zeros_like(w) for w in wrt]
    return ([z if t is None else t for t, z in zip(own, zeros)],
            [z if t is None else t for t, z in zip(derived, zeros)])


def _forward_vjp(applied: Applied, args: tuple, wrt: list[torch.Tensor], seeds: list[torch.Tensor]) -> tuple:
    """The vector-Jacobian product of the forward itself, functionalised as the trace is
    (a forward that writes a saved value in place, e.g. masked_fill_ on a softmax output,
    is differentiable only so)."""
    positions = [i for i, a in enumerate(args) if any(a is w for w in wrt)]

    def forward(*tensors: torch.Tensor) -> tuple:
        call = list(args)
        for i, t in zip(positions, tensors):
            call[i] = t
        out = _compat.tree_flatten(_forward(applied, tuple(call)))[0]
        return tuple(t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point())

    detached = [w.detach() for w in wrt]
    outs, vjp = torch.func.vjp(torch.func.functionalize(forward), *detached)
    if len(outs) != len(seeds):
        raise ValueError("the forward and the Function return different outputs")
    return vjp(tuple(seeds))


def _forward(applied: Applied, args: tuple) -> Any:
    """The Function's forward called directly, so autograd records its ops."""
    cls = applied.cls
    takes_ctx = cls.setup_context is torch.autograd.function._SingleLevelFunction.setup_context
    if takes_ctx:
        return cls.forward(torch.autograd.function.FunctionCtx(), *args, **applied.kwargs)
    return cls.forward(*args, **applied.kwargs)


def _tensor_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in _compat.tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def _shape_of(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return TensorShape(tuple(int(s) for s in arg.shape), arg.dtype, arg.requires_grad)
    return arg


def _example(arg: Any, g: torch.Generator) -> Any:
    if not isinstance(arg, TensorShape):
        return arg
    if arg.dtype.is_floating_point:
        t = torch.rand(arg.shape, generator=g, dtype=torch.float32).mul_(0.5).add_(0.25).to(arg.dtype)
        return t.requires_grad_(arg.requires_grad)
    return torch.zeros(arg.shape, dtype=arg.dtype)

