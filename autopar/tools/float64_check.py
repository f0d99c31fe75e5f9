"""The sweep's float64 re-check of an fp32 difference: the same model and inputs in
float64, with every cast the model's own code makes to a lower float precision kept in
float64, so the reference and the parallel program round alike (some 1e8 times below any
real mistake's size) and a difference that remains is a mistake, not rounding.

Many models compute parts in float32 whatever their dtype: Gemma 4's norms, its query, key
and value projections and its softmax call `.float()` or pass `dtype=torch.float32`. Turned
to float64 with `model.double()` alone, those parts still round at float32's 1e-7, and a
sharded sum there (a vocabulary-split head, a tied embedding's gradient) differs from one
device by more than float64's tolerances although the math is the same."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode

_LOWER = frozenset({torch.float32, torch.float16, torch.bfloat16})
# tensor methods that cast to a fixed lower float precision
_FIXED_CASTS: frozenset[Callable] = frozenset({torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16})
# tensor methods whose positional arguments may name a dtype
_CASTS_BY_ARGUMENT: frozenset[Callable] = frozenset({torch.Tensor.to, torch.Tensor.type})


def in_float64(model: torch.nn.Module, kwargs: dict) -> tuple[torch.nn.Module, dict]:
    """The model (in place) and its inputs in float64; run it, trace it and check it inside
    `float64_math()`. Mixture-of-experts layers that run on torch._grouped_mm, which has no
    float64 kernel, switch to transformers' batched_mm experts (each token's expert weights
    gathered, then batched matmuls): the same math, and traceable, where the eager loop
    over experts is not (its trip count depends on the routing)."""
    if getattr(getattr(model, "config", None), "_experts_implementation", None) == "grouped_mm":
        model.set_experts_implementation("batched_mm")
    kwargs = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    return model.double(), kwargs


class float64_math(TorchFunctionMode):
    """While active, a cast or a `dtype=` argument that asks for float32, float16 or
    bfloat16 gives float64 instead. torch.export traces through it, so a program traced
    inside holds the float64 ops and runs without it."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _FIXED_CASTS:
            return args[0].to(torch.float64)
        if kwargs.get("dtype") in _LOWER:
            kwargs["dtype"] = torch.float64
        if func in _CASTS_BY_ARGUMENT:
            args = tuple(torch.float64 if a in _LOWER else a for a in args)
        return func(*args, **kwargs)
