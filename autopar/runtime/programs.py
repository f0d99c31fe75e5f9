"""The one cache of a ParallelModule's programs, found by the call that needs them.

    call -> its signature -> the program compiled for it, or compile_fn (trace, plan, emit)

Without Options.dynamic a program serves one static signature: the input tree, its
non-tensor values, every tensor's shape and dtype, and the module's mode (training and
evaluation trace different graphs). With it, each mode keeps a DynamicPlans
(passes/plan/dynamic_plans.py), one program per range of sizes. Local inputs
(pm(..., local_inputs=True)) are matched by the blocks each program's input layouts give
this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from autopar.core.dynamic import Dynamic
from autopar.core.log import LOG
from autopar.passes.trace.trace import flatten_inputs
from autopar.passes.plan.dynamic_plans import DynamicPlans, PlannedSignature

Shapes = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@dataclass(frozen=True)
class StaticSignature:
    structure: str  # the input tree (args and kwargs) as torch's pytree spells it
    constants: str  # the non-tensor leaves
    shapes: Shapes  # each tensor leaf's shape and dtype
    training: bool

    @staticmethod
    def of(args: tuple, kwargs: dict, training: bool) -> "StaticSignature":
        return StaticSignature.of_flat(*flatten_inputs(args, kwargs), training)

    @staticmethod
    def of_flat(tensors: list[torch.Tensor], spec: Any, consts: tuple, training: bool) -> "StaticSignature":
        """From the call's inputs as flatten_inputs gives them."""
        return StaticSignature(str(spec), repr(consts), shapes_of(tensors), training)


def shapes_of(tensors: list[torch.Tensor]) -> Shapes:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


class ProgramCache:
    """`compile_fn(args, kwargs, dynamic_shapes=None)` makes a program (every rank takes part)."""

    def __init__(self, dynamic: Optional[Dynamic], compile_fn: Callable[..., Any]) -> None:
        self.dynamic, self.compile_fn = dynamic, compile_fn
        self._static: dict[StaticSignature, Any] = {}
        self._ranges: dict[bool, DynamicPlans] = {}  # the module's mode -> its programs by range

    def compiled(self, args: tuple, kwargs: dict, training: bool) -> Any:
        if self.dynamic is not None:
            return self._of_mode(training).compiled(args, kwargs)
        key = StaticSignature.of(args, kwargs, training)
        if key not in self._static:
            if self._static:
                LOG.info("planning again for a new input signature (%s, %s): program %d", key.shapes,
                         "training" if training else "evaluation", len(self._static) + 1)
            self._static[key] = self.compile_fn(args, kwargs)
        return self._static[key]

    def cached(self, tensors: list[torch.Tensor], spec: Any, consts: tuple, training: bool) -> Optional[Any]:
        """The program already compiled for a call with these flattened inputs, or None (with
        Options.dynamic: None, as its programs are found by the call that needs them)."""
        if self.dynamic is not None:
            return None
        return self._static.get(StaticSignature.of_flat(tensors, spec, consts, training))

    def for_local(self, tensors: list[torch.Tensor], spec: Any, consts: tuple, training: bool,
                  mesh_shape: tuple[int, ...], user_specs: Callable[[Any], list],
                  local_shapes: Callable[[Any], Shapes]) -> Optional[Any]:
        """The program whose inputs' blocks on this rank have these shapes (None: none yet)."""
        if self.dynamic is not None:
            return self._of_mode(training).for_local(tensors, (str(spec), repr(consts)), mesh_shape, user_specs)
        shapes = shapes_of(tensors)
        for key, compiled in self._static.items():
            if (key.structure, key.constants, key.training) == (str(spec), repr(consts), training) and \
                    local_shapes(compiled) == shapes:
                return compiled
        return None

    def __len__(self) -> int:
        return len(self.all())

    def __iter__(self):
        return iter(self.all())

    def all(self) -> list[Any]:
        """Every program, in the order they were made (static ones, then each mode's ranges)."""
        return list(self._static.values()) + [c for r in self._ranges.values() for c in r.compiled_programs()]

    def signatures(self) -> list[PlannedSignature]:
        """What each program serves (with Options.dynamic, its symbolic dims and ranges)."""
        static = [PlannedSignature(tuple((p, s, dtype) for p, (s, dtype) in zip(c.traced.input_paths, key.shapes)))
                  for key, c in self._static.items()]
        return static + [p for r in self._ranges.values() for p in r.plans]

    def _of_mode(self, training: bool) -> DynamicPlans:
        if training not in self._ranges:
            self._ranges[training] = DynamicPlans(self.dynamic, self.compile_fn)
        return self._ranges[training]
