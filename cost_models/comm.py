"""alpha-beta costs of collectives on one mesh axis of n ranks, ring algorithms:
all-reduce moves 2(n-1)/n of the buffer in 2(n-1) steps; all-gather, reduce-scatter
and all-to-all move (n-1)/n of the full buffer in n-1 steps."""

from __future__ import annotations

from autopar.cost_models.devices import Link


def all_reduce_s(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * nbytes * link.beta_s_per_byte


def all_gather_s(full_nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * full_nbytes * link.beta_s_per_byte


def reduce_scatter_s(full_nbytes: float, n: int, link: Link) -> float:
    return all_gather_s(full_nbytes, n, link)


def all_to_all_s(nbytes: float, n: int, link: Link) -> float:
    return all_gather_s(nbytes, n, link)
