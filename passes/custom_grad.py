"""User-defined torch.autograd.Functions met while tracing for training.

torch.export (non-strict) runs a custom Function's `forward` and records its ops; its
own `backward` is not in the exported graph. Differentiating the recorded forward is not
that backward in general: straight-through estimators, YOSO's approximate attention
gradient and Reformer's reversible layers (whose forward runs under no_grad and whose
backward recomputes) all differ. A training trace of such a model would give gradients
that are not the model's, so trace refuses it, naming the Functions; inference is
exact (the forward is what one device runs)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def custom_functions_applied() -> Iterator[list[str]]:
    """While the block runs, the qualified names of user-defined autograd.Functions
    applied with gradients enabled are appended to the yielded list (torch's own, under
    `torch.`, are exact by construction and left out)."""
    seen: list[str] = []
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if torch.is_grad_enabled() and not cls.__module__.startswith("torch."):
            name = f"{cls.__module__}.{cls.__qualname__}"
            if name not in seen:
                seen.append(name)
        return original.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = original
