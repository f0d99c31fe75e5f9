"""How much of a causal attention's score matrix a rank computes, and what the balanced
form's swaps cost (autopar/core/causal.py).

The analytic sdpa FLOPs (compute.sdpa_flops) count every query-key pair of the local
blocks. A causal kernel skips the pairs above the diagonal (FlashAttention on GPUs,
torch's fused CPU kernel), the masked form of split rows computes every pair under its
mask, and the balanced form computes each half-block against the keys before its end:

    rows whole             the triangle: L (L + 1) / 2 of L x S pairs (S >= L)
    rows split, one axis   balanced: the busiest rank's pairs (core.causal.balanced_scores)
    rows split, more axes  masked: every pair of rows x L
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Optional

from autopar.core.causal import balanced_scores
from autopar.core.placement import Spec, largest_block
from autopar.cost_models.devices import Link


@dataclass(frozen=True)
class CausalScores:
    """The share of the local pairs a rank computes; `axis` the balanced form's axis."""

    share: float
    axis: Optional[int] = None


def causal_scores(inputs: tuple[Spec, ...], mesh_shape: tuple[int, ...]) -> CausalScores:
    """The busiest rank's share of its local query-key pairs for causal sdpa(q, k, v)."""
    q, k = inputs[0], inputs[1]
    rows, length = q.meta.shape[2], k.meta.shape[2]
    axes = q.shard_axes(2)
    if not axes:
        near = min(rows, length)  # row i sees keys 0..i, all of them from row S - 1 on
        seen = near * (near + 1) // 2 + (rows - near) * length
        return CausalScores(seen / (rows * length) if rows * length else 1.0)
    if len(axes) > 1:
        return CausalScores(1.0)
    ways, unit = mesh_shape[axes[0]], q.placements[axes[0]].unit  # type: ignore[union-attr]
    local_rows = largest_block(rows, ways, unit)
    return CausalScores(balanced_scores(length, ways, unit) / (local_rows * length), axes[0])


def swaps_s(inputs: tuple[Spec, ...], outputs: tuple[Spec, ...], mesh_shape: tuple[int, ...], link: Link,
            training: bool, sync_s: float) -> float:
    """The balanced form's swaps on its axis: half the local query rows to the mirror and
    their results back (all-to-alls with one non-empty split: a message each way plus
    the empty ones' latency), and in training their gradients the other way."""
    axis = inputs[0].shard_axes(2)[0]
    n = mesh_shape[axis]
    q_half = prod(inputs[0].local_shape(mesh_shape)) * inputs[0].meta.dtype.itemsize / 2
    out_half = prod(outputs[0].local_shape(mesh_shape)) * outputs[0].meta.dtype.itemsize / 2
    one_way = sum((n - 1) * link.alpha_s + b * link.beta_s_per_byte + sync_s for b in (q_half, out_half))
    return one_way * (2.0 if training else 1.0) if n > 1 else 0.0
