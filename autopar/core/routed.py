"""Routed experts: one op for a mixture-of-experts layer's routed part, so that the
experts can be split over a mesh axis with tokens sent to them (expert parallelism).

    routed_experts(ids[S], rows: [src_i], experts: [w_j[E, ...]], row_group, num_experts, body) -> y[S, ...]

Row s of the S routed rows (one per token and chosen expert, in the model's order) is
y[s] = body_e(s)(src_0[s // row_group[0]], src_1[s // row_group[1]], ...) with
e(s) = ids[s]: every row is computed alone by its expert. `body` names a graph
(`register_body`) that takes (offsets, the rows sorted by expert, the experts) and
computes every row, the rows of expert e being sorted rows offsets[e-1]..offsets[e]
(torch._grouped_mm's contract). The trace pass passes/trace/experts.py makes such a node
out of the sort, gathers, grouped matmuls and unsort of transformers' MoE layers.

Since rows are independent, the op splits three ways on one mesh axis (passes/rules/moe.py):
  rows    ids and sources split by rows, experts whole: each rank its own tokens;
  experts ids and sources split by rows, experts split by expert: each rank sends each
          row to the rank holding its expert and takes the result back (all-to-all,
          autopar/runtime/experts.py); `owners` below says where a row goes;
  masked  ids and sources whole, experts split: each rank computes the rows of its own
          experts, zeros elsewhere; the ranks' outputs sum to y (a partial sum).
The op's own kernel (CompositeImplicitAutograd: autograd and fake tensors see its ops)
is the whole computation, which the first way and replication run as they are.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import fx

_SCHEMA = "(Tensor ids, Tensor[] rows, Tensor[] experts, int[] row_group, int num_experts, str body) -> Tensor"

# body name -> graph module; each process registers the bodies of the graphs it traces
_BODIES: dict[str, fx.GraphModule] = {}


def register_body(body: fx.GraphModule) -> str:
    """A stable name for `body` (a digest of its code), registered in this process."""
    name = "experts_" + hashlib.sha256(body.code.encode()).hexdigest()[:16]
    _BODIES.setdefault(name, body)
    return name


def body_of(name: str) -> fx.GraphModule:
    if name not in _BODIES:
        raise KeyError(f"routed experts body {name!r} is not registered in this process: it is made when the "
                       "model is traced (passes/trace/experts.py); trace the model here before running its plan")
    return _BODIES[name]


def group_offsets(sorted_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Cumulative row counts of experts 0..num_experts-1 (int32, grouped_mm's offsets);
    histc keeps a fixed output size, so fake tensors can run it."""
    counts = torch.histc(sorted_ids.float(), bins=num_experts, min=0, max=num_experts - 1)
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def run_sorted(ids: torch.Tensor, rows: Sequence[torch.Tensor], experts: Sequence[torch.Tensor],
               row_group: Sequence[int], num_experts: int, body: str) -> torch.Tensor:
    """The op on rows whose ids all lie in [0, num_experts): sort by expert, run the
    body on each expert's rows, put the rows back in their order."""
    perm = torch.argsort(ids, stable=True)
    sorted_rows = [src[perm // g] if g != 1 else src[perm] for src, g in zip(rows, row_group)]
    y = body_of(body)(group_offsets(ids[perm], num_experts), *sorted_rows, *experts)
    return y[torch.argsort(perm)]


def _routed_experts(ids: torch.Tensor, rows: list[torch.Tensor], experts: list[torch.Tensor], row_group: list[int],
                    num_experts: int, body: str) -> torch.Tensor:
    # through the module as imported now: a fresh import (tests/test_layers.py clears
    # autopar's modules) keeps the op of the first and the bodies of the new one
    return sys.modules[__name__].run_sorted(ids, rows, experts, row_group, num_experts, body)


def _define() -> None:
    if hasattr(torch.ops.autopar, "routed_experts"):
        return
    lib = torch.library.Library("autopar", "FRAGMENT")
    lib.define("routed_experts" + _SCHEMA)
    lib.impl("routed_experts", _routed_experts, "CompositeImplicitAutograd")
    _LIBRARIES.append(lib)  # a library object unregisters its ops when collected


_LIBRARIES: list = []
_define()

ROUTED_EXPERTS = torch.ops.autopar.routed_experts.default


def masked_rows(start: int, ids: torch.Tensor, rows: list[torch.Tensor], experts: list[torch.Tensor],
                row_group: list[int], num_experts: int, body: str) -> torch.Tensor:
    """The rows of experts start..start + len(experts[0]) computed with those experts (this
    rank's block of them), zeros for every other row: one summand of the op's output."""
    local = experts[0].shape[0]
    mine = ((ids >= start) & (ids < start + local)).nonzero().squeeze(-1)
    picked = [src[mine // g] if g != 1 else src[mine] for src, g in zip(rows, row_group)]
    y = run_sorted(ids[mine] - start, picked, experts, [1] * len(rows), local, body)
    out = y.new_zeros((ids.shape[0],) + tuple(y.shape[1:]))
    return out.index_put((mine,), y)


@dataclass(frozen=True)
class ExpertParallel:
    """The local form of routed_experts with rows and experts split on mesh axis `axis`:
    each row goes to the rank holding its expert and back, so it needs that axis's
    process group. The rewrite makes it a module of the rank program
    (passes/lower/program.py ExpertsModule) that the runtime binds to the group."""

    axis: int

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(f"expert parallelism on mesh axis {self.axis} exchanges rows between the ranks of that "
                           "axis; it runs inside a rank program bound to its process groups (autopar.compile)")
