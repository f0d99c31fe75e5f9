"""Causal self-attention with its rows split on one mesh axis, balanced on this rank's
process group (autopar/core/causal.py): the second half of this rank's rows goes to the
mirror coordinate size - 1 - c of the axis and the mirror's comes here, as an all-to-all
with one non-empty split; the results go back the same way. The exchange is an autograd
function whose backward sends the gradients the other way, so every gradient lands on
the rank that holds its rows (keys and values are whole here: their gradients are
summed by the all-gather's conjugate that made them whole)."""

from __future__ import annotations

from typing import Optional

import torch

from autopar.core.causal import balanced_causal_rows
from autopar.runtime.collectives import AxisComm, rows_all_to_all


def balanced_attention(comm: AxisComm, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, unit: int,
                       dropout_p: float = 0.0, scale: Optional[float] = None, enable_gqa: bool = False
                       ) -> torch.Tensor:
    """This rank's rows of causal self-attention, half of them computed by the mirror."""
    mirror = comm.size - 1 - comm.coord

    def swap(rows: torch.Tensor, coming: int) -> torch.Tensor:
        if comm.stand_in:  # one rank timed alone: the mirror's rows are as many as its own
            return _as_many(rows, coming)
        sent, got = [0] * comm.size, [0] * comm.size
        sent[mirror], got[mirror] = rows.shape[-2], coming
        moved = rows_all_to_all(rows.movedim(-2, 0), got, sent, comm)
        return moved.movedim(0, -2)

    return balanced_causal_rows(query, key, value, comm.coord, comm.size, unit, swap, dropout_p, scale,
                                enable_gqa)


def _as_many(rows: torch.Tensor, n: int) -> torch.Tensor:
    """`n` rows (dim -2) shaped like `rows`: its own first ones, zeros beyond."""
    if rows.shape[-2] >= n:
        return rows.narrow(-2, 0, n)
    pad = rows.new_zeros(rows.shape[:-2] + (n - rows.shape[-2], rows.shape[-1]))
    return torch.cat([rows, pad], dim=-2)
