"""Expert parallelism on one mesh axis: routed rows sent to the rank that holds their
expert and the results sent back (autopar/core/routed.py's op with rows and experts split).

    this rank's rows --sort by expert--> [to rank 0 | to rank 1 | ...]
        1. counts: how many rows go to each expert (all-to-all of E integers), so each
           rank knows how many rows of each of its experts every source sends
        2. dispatch: the rows of every source (all-to-all, uneven splits), each source's
           sorted by expert, so their experts follow from the counts
        3. compute: the received rows of this rank's experts, grouped by expert (the body)
        4. combine: results back to the ranks they came from (all-to-all, splits swapped)
        5. unsort: rows back in this rank's order
Rank c of the axis holds experts [c * E_c, (c + 1) * E_c). Steps 2 and 4 are autograd
functions whose backward is the all-to-all the other way round, so gradients reach the
rows' ranks and every expert's gradient is whole on its rank.
"""

from __future__ import annotations

from typing import Sequence

import torch

from autopar.core.routed import run_sorted
from autopar.runtime.collectives import AxisComm, exchange_rows, rows_all_to_all


def expert_parallel(comm: AxisComm, ids: torch.Tensor, rows: Sequence[torch.Tensor], experts: Sequence[torch.Tensor],
                    row_group: Sequence[int], body: str) -> torch.Tensor:
    """This rank's routed rows (ids and row sources split over the axis with the
    experts), each computed by its expert on that expert's rank (module docstring)."""
    n, local = comm.size, experts[0].shape[0]
    perm = torch.argsort(ids, stable=True)
    # 1. counts: per_expert[q, e] rows for expert e of rank q; got[q, e] from rank q for my expert e
    per_expert = torch.histc(ids.float(), bins=n * local, min=0, max=n * local - 1).to(torch.int64).view(n, local)
    got_per_expert = exchange_rows(per_expert.reshape(-1), [local] * n, [local] * n, comm).view(n, local)
    send_splits, recv_splits = per_expert.sum(1).tolist(), got_per_expert.sum(1).tolist()
    # 2. dispatch
    sent = [src[perm // g] if g != 1 else src[perm] for src, g in zip(rows, row_group)]
    got = [rows_all_to_all(r, recv_splits, send_splits, comm) for r in sent]
    got_ids = torch.repeat_interleave(torch.arange(local, device=ids.device).repeat(n), got_per_expert.reshape(-1))
    # 3. compute
    y = run_sorted(got_ids, got, experts, [1] * len(got), local, body)
    # 4. combine, 5. unsort
    back = rows_all_to_all(y, send_splits, recv_splits, comm)
    return back[torch.argsort(perm)]


def expert_parallel_standing_in(comm: AxisComm, ids: torch.Tensor, rows: Sequence[torch.Tensor],
                                experts: Sequence[torch.Tensor], row_group: Sequence[int], body: str) -> torch.Tensor:
    """One rank timed alone (runtime/measure.py): its own rows computed by its experts as
    if routing were balanced (every row kept here, ids folded onto the local experts)."""
    local = experts[0].shape[0]
    return run_sorted(ids % local, rows, experts, row_group, local, body)
