"""Causal self-attention with its query rows split along the sequence (context
parallelism with keys and values gathered): the local forms a rank runs, and how much
of the score matrix each computes.

Split contiguously over `ways` ranks, rank c's rows [c*b, (c+1)*b) see keys up to their
own position: the last rank's rows see every key, the first's a `ways`-th of them. Two
local forms:

  masked    (causal_rows_attention) each rank's rows against every key under an offset
            mask: every rank computes rows x L scores, twice what the causal half needs.
  balanced  (balanced_causal_rows) each rank's block is cut in two halves; rank c keeps
            its first half and swaps its second with the second half of rank
            ways - 1 - c (its mirror), and each half is computed against the keys before
            its end only. Rank c then computes half-blocks 2c and 2(ways - c) - 1 of the
            2 * ways, the head-tail pairing torchtitan and Megatron balance with, so every
            rank computes about (2 ways + 1) / (4 ways) of the masked form's scores, the
            whole sequence's causal triangle over `ways` (the swap moves half the rows
            there and back: their queries forward, results back; gradients the reverse).
            The values are the masked form's, row for row.

The balanced form needs the mirror's rows, so it runs where the rows are split on one
mesh axis: a rank program's module bound to that axis's process group
(passes/lower/program.py CausalRowsModule); anywhere else (rule checks, timings of one
rank) BalancedCausalRows computes the same values without exchanging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from autopar.core.placement import largest_block

aten = torch.ops.aten

# (rows to send to the mirror, how many rows come back from it) -> the rows received
Swap = Callable[[torch.Tensor, int], torch.Tensor]


def causal_rows_attention(chunk: int, ways: int, unit: int, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                          is_causal: bool = True, *, scale: Optional[float] = None, enable_gqa: bool = False
                          ) -> torch.Tensor:
    """Causal self-attention of the query rows of torch.chunk block `chunk` of `ways` in
    units of `unit` (the rule splits rows only where there are as many queries as keys,
    so the whole length is the keys'): rows [start, start + rows), row i sees key j where
    j <= start + i, as torch's is_causal has it for the whole; `attn_mask` is always None
    here (torch refuses it with is_causal). Every block reads all the keys (the last
    needs them all), so every rank runs the shapes rank 0 runs, which the profile times."""
    start = chunk * largest_block(key.shape[-2], ways, unit)
    return prefix_attention(query, key, value, start, dropout_p, scale, enable_gqa, key.shape[-2])


def prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, start: int, dropout_p: float,
                     scale: Optional[float], enable_gqa: bool, keys: Optional[int] = None) -> torch.Tensor:
    """Rows [start, start + rows) of causal self-attention against the first `keys` keys
    (default: up to the last row, all a causal row may see)."""
    rows = query.shape[-2]
    if rows == 0:
        return query.new_zeros(query.shape[:-1] + (value.shape[-1],))
    keys = start + rows if keys is None else keys
    positions = start + torch.arange(rows, device=query.device)
    visible = torch.arange(keys, device=query.device) <= positions.unsqueeze(-1)
    return aten.scaled_dot_product_attention.default(query, key[..., :keys, :], value[..., :keys, :], visible,
                                                     dropout_p, False, scale=scale, enable_gqa=enable_gqa)


def row_halves(length: int, ways: int, unit: int, chunk: int) -> tuple[int, int, int]:
    """(start, middle, end) of block `chunk`'s rows: the first half [start, middle) stays,
    the second [middle, end) goes to the mirror. Empty blocks (a short sequence's last
    ones) give start == middle == end."""
    step = largest_block(length, ways, unit)
    start, end = min(chunk * step, length), min((chunk + 1) * step, length)
    return start, start + (end - start) // 2, end


def balanced_causal_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int, ways: int,
                         unit: int, swap: Swap, dropout_p: float = 0.0, scale: Optional[float] = None,
                         enable_gqa: bool = False) -> torch.Tensor:
    """This rank's rows (block `chunk` of `ways`, keys and values whole) of causal
    self-attention, balanced with the mirror rank (module docstring); `swap` trades
    rows with the mirror (dim -2), as an all-to-all on a rank or in place alone."""
    first, second = halves(query, key.shape[-2], ways, unit, chunk)
    _, their_middle, their_end = row_halves(key.shape[-2], ways, unit, ways - 1 - chunk)
    theirs = swap(second, their_end - their_middle)
    mine, for_them = attend_halves(first, theirs, key, value, chunk, ways, unit, dropout_p, scale, enable_gqa)
    return torch.cat([mine, swap(for_them, second.shape[-2])], dim=-2)


def halves(query: torch.Tensor, length: int, ways: int, unit: int, chunk: int) -> tuple[torch.Tensor, ...]:
    """Block `chunk`'s query rows as (the half it keeps, the half its mirror computes)."""
    start, middle, end = row_halves(length, ways, unit, chunk)
    return query.split([middle - start, end - middle], dim=-2)


def attend_halves(first: torch.Tensor, theirs: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int,
                  ways: int, unit: int, dropout_p: float, scale: Optional[float], enable_gqa: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows block `chunk` computes: its first half and the mirror's second half."""
    start, _, _ = row_halves(key.shape[-2], ways, unit, chunk)
    _, their_middle, _ = row_halves(key.shape[-2], ways, unit, ways - 1 - chunk)
    return (prefix_attention(first, key, value, start, dropout_p, scale, enable_gqa),
            prefix_attention(theirs, key, value, their_middle, dropout_p, scale, enable_gqa))


def balanced_scores(length: int, ways: int, unit: int) -> int:
    """Scores (query-key pairs) the busiest rank computes in the balanced form."""
    busiest = 0
    for chunk in range(ways):
        start, middle, _ = row_halves(length, ways, unit, chunk)
        _, their_middle, their_end = row_halves(length, ways, unit, ways - 1 - chunk)
        busiest = max(busiest, _prefix_scores(start, middle) + _prefix_scores(their_middle, their_end))
    return busiest


def _prefix_scores(start: int, end: int) -> int:
    """Scores of rows [start, end) each against the keys before the block's end."""
    return (end - start) * end


def causal_scores(length: int) -> int:
    """Scores a causal kernel computes for the whole: the triangle with its diagonal."""
    return length * (length + 1) // 2


@dataclass(frozen=True)
class BalancedCausalRows:
    """The balanced local form (module docstring) of causal self-attention whose rows are
    block `chunk` of `ways` (in units of `unit`) along mesh axis `axis`. Called, it computes
    this rank's rows without the mirror (the values a rank program gets by swapping)."""

    axis: int
    chunk: int
    ways: int
    unit: int

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0, is_causal: bool = True, *,
                 scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
        return causal_rows_attention(self.chunk, self.ways, self.unit, query, key, value, attn_mask, dropout_p,
                                     is_causal, scale=scale, enable_gqa=enable_gqa)


def sdpa_is_causal(args: tuple, kwargs: dict) -> bool:
    """sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale, enable_gqa)."""
    return bool(args[5] if len(args) > 5 else kwargs.get("is_causal", False))
