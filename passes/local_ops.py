"""Ops a rank runs in place of an ATen op whose sharded form is not the same op on the
local block (the rewrite substitutes them; passes/rewrite.py localize_call).

    embedding_block   a vocabulary-split embedding (Megatron's vocab-parallel embedding):
                      rows [start, start + local rows) live here; ids outside look up
                      nothing and give zeros, so the ranks' outputs sum to the full
                      lookup (the rule's output is P)
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def embedding_block(weight: torch.Tensor, indices: torch.Tensor, start: int, padding_idx: int = -1,
                    scale_grad_by_freq: bool = False, sparse: bool = False) -> torch.Tensor:
    rows = weight.shape[0]
    local = indices - start
    inside = (local >= 0) & (local < rows)
    pad = padding_idx - start if 0 <= padding_idx - start < rows else -1
    out = aten.embedding.default(weight, local.clamp(0, rows - 1), pad, scale_grad_by_freq, sparse)
    return out * inside.unsqueeze(-1).to(out.dtype)
