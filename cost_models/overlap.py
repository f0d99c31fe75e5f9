"""The overlapped step: how much of a step's communication runs under its compute,
priced the way the runtime executes it, by one formula that evaluate() and the solver's
ILP both use (so the ILP's objective is the step evaluate() prices). In training all
that follows; in inference (forward only) there are no buckets, and on presets whose
collectives run beside compute the prefetch and activation windows' forward parts.

What overlaps at run time, and what this model credits:

    data-parallel gradient buckets     launched during backward the moment their last
    (autopar/runtime/buckets.py)       gradient exists, waited once at its end: they hide
                                       under the backward compute that follows the launch
    a parameter's first reshard        (GPU presets, DeviceSpec.collectives_beside_compute)
    (FSDP's gather, passes/lower/        issued as soon as the previous parameter use has
    schedule.py prefetch)              run, waited before its own use: it hides under the
                                       forward compute between the two uses, its conjugate
                                       (the gradient's reduce-scatter) under their backward
    every other collective             priced where it sits (blocking): activation
                                       collectives of a dependent chain (Megatron's
                                       all-reduces) and their conjugates

Stretches. Backward runs the program's nodes in reverse. Bucket k launches after the
backward of its earliest-used parameter's first consumer, at program position p_k;
sorted by launch (p_1 >= p_2 >= ...), the stretch of bucket k is the backward of the
nodes at positions [p_{k+1}, p_k) (the last bucket's: [0, p_K)), the compute that runs
between its launch and the next one's. Per stretch the step pays the larger of that
compute and the bucket's all-reduce:

    hidden_k = min(S_k, C_k)        S_k: the bucket's all-reduce seconds
                                    C_k: its stretch's backward seconds

so a bucket launched after the last backward op (an embedding's gradient comes last)
hides nothing: compute and comm add up. Two simplifications keep this linear in the
plan's choices, so that the ILP states it exactly with no extra rows (a max() per
stretch made an 8B-parameter plan's solve 20-50x slower):

1. C_k is the least backward compute the stretch's ops have under any of their
   strategies (what hides under any plan), not the chosen plan's;
2. the credit is taken per edge, each parameter edge getting a share of C_k in
   proportion to its parameter's bytes (split evenly over the parameter's uses):
   hidden_e = min(H_e, share_e), with H_e the edge's reduction a bucket carries (the
   backward of its first grad sync, when every step is a grad sync: the rewrite defers
   exactly those; further axes are reduced after the wait, exposed).
Neither credits more than the prices allow: each edge's credit is at most its own
price H_e, and the shares of a stretch sum to C_k, so sum_e min(H_e, share_e) is at most
min(sum_e H_e, C_k). (sum_e H_e is the per-edge price of the bucket, which counts one
latency per edge where the bucket's one all-reduce S_k pays one: against S_k itself the
credit can be larger by those latencies.) Backlog carried from one stretch into the next
is not credited.

Prefetch windows. Let q_1 < q_2 < ... be the program positions where parameters are
used. The first reshard step of a parameter edge into q_j starts after the node at
q_{j-1} and is waited before q_j: its window is the nodes strictly between (from the
program's start for q_1). With F_j and B_j the window's least forward and backward
seconds (under any strategy, as C_k above), each edge at q_j takes a share of them by
its parameter's bytes among the parameters used there, and

    hidden_e += min(Hf_e, share_f) + min(Hb_e, share_b)

Hf_e, Hb_e: the forward and backward seconds of the edge's first step, where it
communicates and is not a grad sync (those are the buckets'); on presets whose
collectives compete with compute for the same cores (the CPU over gloo) both are 0.
Several gathers prefetched into one window each take their own share, so together they
are credited at most the window's compute.

Bucket membership is read off the graph, not the plan: parameters in reverse program
order, BUCKET_BYTES of their global bytes per bucket (the runtime fills buckets with
local bytes: with sharded parameters this counts fewer, larger buckets, less overlap).
Reduced once per n backwards (Options.grad_sync_every = n: a pipeline stage reduces its
buckets after the last of its n microbatches), a bucket's reduction H costs each backward
H / n (amortised_s: the rest is taken off the edge's communication), and that part is
what hides under its stretch: min(H / n, share_e).

Activation windows. On the same presets an activation edge u -> v (u an op's output,
v an op) is started right after u and waited just before v (passes/lower/schedule.py),
so its first step runs beside the nodes strictly between them and its conjugate beside
their backward: its window is those positions, credited as a parameter's,

    hidden_e += min(Hf_e, share_f) + min(Hb_e, share_b)

Windows overlap (the q, k and v of an attention all wait before it, inside a parameter
window), and the collectives of one rank run one after another, so no position's compute
may be credited twice. The parameters keep their shares above, and the activations get
what those cannot use: the parameters used at the end of a parameter window of C seconds
are credited at most K, the sum of upper bounds on their first steps (the slowest axis's
all-gather of the whole parameter, first_step_bound_s), so 1 - min(1, K/C) of each of the
window's positions is left to the activation windows over it (all of a position past the
last parameter use), split among them by the global bytes they carry. Only windows of at
most MAX_WINDOW positions are credited: a tensor read far away (a rotary table read by
every layer, the residual stream) would be held in flight beside many other collectives,
and windows of one length in every copy of a repeated block keep the copies' shares equal,
so the solver still prices the copies' edges once.

Not modelled: the in-flight cap (it may retire a prefetched gather early).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from types import MappingProxyType
from typing import Callable, Hashable, Mapping, Optional, Sequence

from autopar.core.kinds import NodeKind
from autopar.core.options import GRADIENT_BUCKET_BYTES
from autopar.core.placement import TensorMeta
from autopar.cost_models import comm
from autopar.cost_models.hiding import Share, hidden_s
from autopar.cost_models.model import CostModel

BUCKET_BYTES = GRADIENT_BUCKET_BYTES  # the runtime's bucket size (autopar/runtime/buckets.py)
WINDOW_ENDS = frozenset({NodeKind.OP, NodeKind.GETITEM})  # what an activation window runs between
MAX_WINDOW = 32  # the longest activation window credited, in program positions (module docstring)


@dataclass(frozen=True)
class Bucket:
    """Parameters whose gradients are all-reduced together, and where backward launches it."""

    params: tuple[str, ...]
    launch: int  # program position of the earliest first use among the params


@dataclass(frozen=True)
class ParamUse:
    """One edge out of a parameter: which parameter, where its consumer sits, the edge's id."""

    param: str
    position: int
    edge: Hashable


@dataclass(frozen=True)
class Window:
    """An activation edge's window: the program positions [lo, hi) between its producer
    and its consumer, the compute its first step runs beside, and the global bytes of the
    tensor it carries (its claim on that compute)."""

    edge: Hashable
    lo: int
    hi: int
    nbytes: int


def activation_windows(position: Mapping[str, int], edges: Sequence[tuple[str, str, int, int]],
                       max_window: Optional[int] = None) -> list[Window]:
    """The window of every (producer, consumer, position, bytes) edge between two ops
    (`position` holds the ops' program positions and nothing else), keyed (consumer,
    position), of at least one position and at most `max_window` (MAX_WINDOW)."""
    longest = MAX_WINDOW if max_window is None else max_window
    out = []
    for u, v, pos, nbytes in edges:
        if u in position and v in position and 0 < position[v] - position[u] - 1 <= longest:
            out.append(Window((v, pos), position[u] + 1, position[v], nbytes))
    return out


def activation_terms(kinds: Sequence[tuple[str, NodeKind]], edges: Sequence[tuple[str, int, str, int]],
                     nbytes_of: Callable[[str, int], int], params: Sequence[tuple[str, int]],
                     costs: CostModel) -> tuple[list[Window], dict[str, tuple[float, float]]]:
    """What edge_share_table needs for activation windows, for nodes (name, kind) in
    program order and edges (producer, output, consumer, position): the windows, and
    first_step_bound_s per parameter; none where collectives do not run beside compute.
    `nbytes_of(producer, output)`: the global bytes of an op's output."""
    if not costs.device.collectives_beside_compute:
        return [], {}
    ops = {name: i for i, (name, kind) in enumerate(kinds) if kind in WINDOW_ENDS}
    windows = activation_windows(ops, [(u, v, pos, nbytes_of(u, k)) for u, k, v, pos in edges if u in ops])
    return windows, {p: first_step_bound_s(b, costs) for p, b in params}


def global_nbytes(meta: TensorMeta) -> int:
    try:
        return int(prod(meta.shape)) * meta.dtype.itemsize
    except TypeError:  # a symbolic dim: no size to bucket by; a bucket of its own
        return BUCKET_BYTES


def grad_buckets(params: Sequence[tuple[str, int]], first_use: Mapping[str, int],
                 bucket_bytes: int = BUCKET_BYTES) -> tuple[Bucket, ...]:
    """`params` (name, global bytes) in program order -> buckets filled in reverse order
    (the order backward produces gradients), a new one where the next would overflow,
    sorted by launch (latest program position first). Unused parameters launch nothing."""
    out: list[list[str]] = []
    fill = 0
    for name, nbytes in reversed(params):
        if name not in first_use:
            continue
        if not out or fill + nbytes > bucket_bytes:
            out.append([])
            fill = 0
        out[-1].append(name)
        fill += nbytes
    buckets = [Bucket(tuple(b), min(first_use[p] for p in b)) for b in out]
    return tuple(sorted(buckets, key=lambda b: -b.launch))


def stretches(buckets: Sequence[Bucket]) -> tuple[tuple[int, int], ...]:
    """Per bucket (in launch order), the program positions [lo, hi) whose backward runs
    after its launch and before the next one's."""
    return tuple((buckets[k + 1].launch if k + 1 < len(buckets) else 0, b.launch) for k, b in enumerate(buckets))


def edge_shares(params: Sequence[tuple[str, int]], uses: Sequence[ParamUse],
                least_backward_s: Sequence[float]) -> dict[Hashable, float]:
    """share_e per parameter edge (module docstring, 2.): its bucket's stretch compute
    C_k (from each position's least backward seconds) split over the bucket's parameters
    by bytes, and a parameter's part evenly over its uses."""
    first_use: dict[str, int] = {}
    count: dict[str, int] = {}
    for u in uses:
        first_use[u.param] = min(first_use.get(u.param, u.position), u.position)
        count[u.param] = count.get(u.param, 0) + 1
    nbytes = dict(params)
    buckets = grad_buckets(params, first_use)
    per_param: dict[str, float] = {}
    for b, (lo, hi) in zip(buckets, stretches(buckets)):
        compute_s = sum(least_backward_s[lo:hi])
        total = sum(nbytes[p] for p in b.params)
        for p in b.params:
            per_param[p] = compute_s * (nbytes[p] / total if total else 1.0 / len(b.params))
    return {u.edge: per_param[u.param] / count[u.param] for u in uses}


def window_shares(params: Sequence[tuple[str, int]], uses: Sequence[ParamUse], least_forward_s: Sequence[float],
                  least_backward_s: Sequence[float]) -> dict[Hashable, tuple[float, float]]:
    """(share_f, share_b) per parameter edge: its prefetch window's least forward and
    backward seconds (module docstring), split by bytes over the parameters used at its
    position."""
    nbytes = dict(params)
    out: dict[Hashable, tuple[float, float]] = {}
    previous = -1
    for q, at_q in _uses_by_position(uses):
        forward, backward = sum(least_forward_s[previous + 1:q]), sum(least_backward_s[previous + 1:q])
        total = sum(nbytes[u.param] for u in at_q)
        for u in at_q:
            part = nbytes[u.param] / total if total else 1.0 / len(at_q)
            out[u.edge] = (forward * part, backward * part)
        previous = q
    return out


def _uses_by_position(uses: Sequence[ParamUse]) -> list[tuple[int, list[ParamUse]]]:
    at: dict[int, list[ParamUse]] = {}
    for u in uses:
        at.setdefault(u.position, []).append(u)
    return sorted(at.items(), key=lambda kv: kv[0])


def left_by_parameters(uses: Sequence[ParamUse], least_s: Sequence[float], bound_s: Mapping[str, float]) -> list[float]:
    """Per position, the seconds no parameter edge can be credited: in a parameter window
    of C seconds whose parameters' first steps take at most K seconds together (`bound_s`
    per parameter use), the parameters are credited at most min(K, C), so 1 - min(1, K/C)
    of each of its positions is left; past the last parameter use, all of it."""
    left = list(least_s)
    previous = -1
    for q, at_q in _uses_by_position(uses):
        window = least_s[previous + 1:q]
        compute, need = sum(window), sum(bound_s[u.param] for u in at_q)
        keep = 0.0 if compute <= need else 1.0 - need / compute
        left[previous + 1:q] = [s * keep for s in window]
        previous = q
    return left


def activation_shares(windows: Sequence[Window], left_s: Sequence[float]) -> dict[Hashable, float]:
    """Per activation window, its part of the seconds the parameters leave over its
    positions, each position's split among the windows over it by their bytes."""
    claims = [0] * (len(left_s) + 1)
    for w in windows:
        for i in range(w.lo, w.hi):
            claims[i] += w.nbytes
    return {w.edge: sum(s * (w.nbytes / claims[i]) if claims[i] != w.nbytes else s
                        for i, s in enumerate(left_s[w.lo:w.hi], w.lo)) for w in windows}


def first_step_bound_s(nbytes: int, costs: CostModel) -> tuple[float, float]:
    """Upper bounds on the forward and the backward seconds of a parameter edge's first
    step, for a parameter of `nbytes` global bytes: the slowest axis's all-gather and
    reduce-scatter of all of them (the step is an all-gather or a cheaper all-to-all of at
    most the whole parameter, its backward the conjugate)."""
    def slowest(kind: str) -> float:
        links = [(n, costs.measured_links.get((axis, kind)) or costs.link(axis))
                 for axis, n in enumerate(costs.mesh_shape)]
        return max((comm.all_gather_s(nbytes, n, link) + costs.collective_sync_s for n, link in links if n > 1),
                   default=0.0)
    return slowest("all_gather"), slowest("reduce_scatter")


def edge_share_table(params: Sequence[tuple[str, int]], uses: Sequence[ParamUse], least_forward_s: Sequence[float],
                     least_backward_s: Sequence[float], sync_every: int = 1, activations: Sequence[Window] = (),
                     bound_s: Mapping[str, tuple[float, float]] = MappingProxyType({})) -> dict[Hashable, Share]:
    """Share per parameter edge (its bucket's, edge_shares, and its window's,
    window_shares) and per activation window (activation_shares of what the parameters
    leave, `bound_s`: first_step_bound_s per parameter)."""
    buckets = edge_shares(params, uses, least_backward_s)
    windows = window_shares(params, uses, least_forward_s, least_backward_s)
    table = {e: Share(buckets[e], *windows[e], sync_every) for e in buckets}
    if activations:
        forward = activation_shares(activations, left_by_parameters(uses, least_forward_s,
                                                                    {p: b[0] for p, b in bound_s.items()}))
        backward = activation_shares(activations, left_by_parameters(uses, least_backward_s,
                                                                     {p: b[1] for p, b in bound_s.items()}))
        for w in activations:
            table[w.edge] = Share(0.0, forward[w.edge], backward[w.edge])
    return table


def plan_hidden_s(nodes: Sequence, edges: Sequence, costs: CostModel, least_backward_s: Sequence[float],
                  least_forward_s: Sequence[float], sync_every: int = 1) -> float:
    """Seconds of comm_s hidden under compute, for a plan's nodes (NodeChoice, in program
    order) and edges (EdgePlan); `least_backward_s`, `least_forward_s`: per node, the
    least backward and forward seconds of its strategies (evaluate.least_backward_s);
    `sync_every`: Options.grad_sync_every."""
    if not costs.training and not costs.device.collectives_beside_compute:
        return 0.0
    params = [(n.name, global_nbytes(n.outputs[0].meta)) for n in nodes if n.kind is NodeKind.PARAMETER]
    position = {n.name: i for i, n in enumerate(nodes)}
    uses = parameter_uses(params, position, [(e.producer, e.consumer, e.position) for e in edges])
    by_name = {n.name: n for n in nodes}
    windows, bounds = activation_terms([(n.name, n.kind) for n in nodes],
                                       [(e.producer, e.index, e.consumer, e.position) for e in edges],
                                       lambda u, k: global_nbytes(by_name[u].outputs[k].meta), params, costs)
    shares = edge_share_table(params, uses, least_forward_s, least_backward_s, sync_every, windows, bounds)
    return sum(hidden_s(e.steps, costs, shares[(e.consumer, e.position)])
               for e in edges if (e.consumer, e.position) in shares)


def parameter_uses(params: Sequence[tuple[str, int]], position: Mapping[str, int],
                   edges: Sequence[tuple[str, str, int]]) -> list[ParamUse]:
    """Every (producer, consumer, position) edge out of a parameter, keyed (consumer, position)."""
    names = {p for p, _ in params}
    return [ParamUse(u, position[v], (v, pos)) for u, v, pos in edges if u in names]
