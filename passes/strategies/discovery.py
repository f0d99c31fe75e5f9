"""Sharding rules found by experiment, for ATen ops that have no hand-written rule.

    discover(call) -> list[AxisRule] | None     (None: nothing to try; replicate)

For an op at its traced shapes and arguments:

1. Candidates (one mesh axis): every way to split a set of inputs along dims of one
   common size (the same logical dim seen by each), each floating input alone as a
   partial sum, and all floating inputs as partial sums together (MAX_INPUT_PATTERNS
   input layouts at most, the partial sums always among them); for each, every output
   layout R, S(d), P(sum).
2. Test: random inputs at the traced shapes; the op runs shard by shard on a simulated
   axis (passes/rules/blockwise.py: the same block cutting and shape-argument localisation the
   runtime uses) and the outputs are reassembled under the candidate output layout. A
   candidate holds when the result equals the unsharded op's on two independent draws
   and on 2 and (where it divides) 4 shards: exactly for integer and boolean outputs, to
   float rounding (1e-5 relative) otherwise; zero-element outputs (batch norm's saved
   statistics in eval mode) hold when their shapes match.
3. What holds is the op's rule set (replication always among them), cached per op,
   arguments and shape signature for the life of the process.

Soundness limits and guards. A random test can miss behaviour that random data rarely
shows: value-dependent branches (thresholds, NaN/inf handling), integer inputs used as
indices (drawn from {0, 1}, so out-of-shard indices are exercised but large ones not),
and coincidences on tiny integer tensors. Guards: two draws and two shard counts; a
candidate must hold on every output; ops that are not deterministic on equal inputs
(random ops), ops that write their inputs, and ops whose inputs exceed
DISCOVERY_MAX_ELEMENTS are never tried; hand-written rules always take priority; and
Options.discover_rules=False turns discovery off. autopar.verify checks a whole plan
on the real data.
"""

from __future__ import annotations

from itertools import islice, product
from math import prod
from typing import Any, Iterator, Optional

import torch

from autopar import _compat
from autopar.core.placement import P, Placement, R, Shard, Spec, TensorMeta
from autopar.passes.rules import AxisRule, OpCall, Strategy, TensorArg
from autopar.passes.rules.local import SIZE_ARG_OPS
from autopar.passes.rules.blockwise import assemble, run_blocks

DISCOVERY_MAX_ELEMENTS = 1 << 20  # per call, summed over inputs and outputs
MAX_INPUT_PATTERNS = 64  # input layouts tried per op, over all candidates
SHARD_COUNTS = (2, 4)
SEEDS = (0, 1)


def discover(call: OpCall) -> Optional[list[AxisRule]]:
    """Every verified per-axis rule of `call` (replication first), or None when the op
    cannot be tried (no tensor inputs, too large, random, or failing on random data)."""
    if not call.inputs or not call.outputs or _writes_inputs(call.target) or call.target in SIZE_ARG_OPS:
        return None  # SIZE_ARG_OPS (hand rules in views.py) run shard by shard as their output layout says
    if sum(prod(m.shape) for m in call.inputs + call.outputs) > DISCOVERY_MAX_ELEMENTS:
        return None
    key = (call.target, _freeze(call.args), _freeze(call.kwargs), call.inputs, call.outputs)
    try:
        hash(key)
    except TypeError:
        return None
    found = _discover_cached(key, call)
    return list(found) if found is not None else None


_CACHE: dict[tuple, Optional[tuple[AxisRule, ...]]] = {}


def _discover_cached(key: tuple, call: OpCall) -> Optional[tuple[AxisRule, ...]]:
    if key not in _CACHE:
        _CACHE[key] = _discover(call)
    return _CACHE[key]


def _writes_inputs(target: Any) -> bool:
    """In-place and out= ops would change the shared random inputs between candidates
    (traced graphs are functional where it matters: passes/trace/trace.py)."""
    schema = getattr(target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def cache_clear() -> None:
    _CACHE.clear()


def _freeze(x: Any) -> Any:
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    return x


# ---- 1. candidates -----------------------------------------------------------------

def input_patterns(call: OpCall) -> list[tuple[Placement, ...]]:
    """At most MAX_INPUT_PATTERNS input layouts: the partial-sum ones always, splits in
    order of dim size up to the cap."""
    n = len(call.inputs)
    floats = [i for i, m in enumerate(call.inputs) if m.dtype.is_floating_point]
    partials = [tuple(P if j == i else R for j in range(n)) for i in floats]
    if len(floats) > 1:
        partials.append(tuple(P if j in floats else R for j in range(n)))
    room = max(0, MAX_INPUT_PATTERNS - len(partials))
    return (list(islice(_split_patterns(call), room)) + partials)[:MAX_INPUT_PATTERNS]


def _split_patterns(call: OpCall) -> Iterator[tuple[Placement, ...]]:
    """Inputs split along dims of one common size, lazily (the product can be huge); a
    split belongs to one size, so none repeats."""
    for size in sorted({s for m in call.inputs for s in m.shape if s > 1}):
        options = [[R] + [Shard(d) for d, s in enumerate(m.shape) if s == size] for m in call.inputs]
        for combo in product(*options):
            if any(p != R for p in combo):
                yield tuple(combo)


def output_options(meta: TensorMeta) -> list[Placement]:
    out: list[Placement] = [R] + [Shard(d) for d, s in enumerate(meta.shape) if s > 1]
    if meta.dtype.is_floating_point:
        out.append(P)
    return out


# ---- 2. tests ----------------------------------------------------------------------

def _random(meta: TensorMeta, gen: torch.Generator) -> torch.Tensor:
    if meta.dtype.is_floating_point:
        return torch.randn(meta.shape, generator=gen, dtype=torch.float64).to(meta.dtype)
    if meta.dtype == torch.bool:
        return torch.randint(0, 2, meta.shape, generator=gen).bool()
    if meta.dtype.is_complex:
        raise TypeError("complex inputs are not tried")
    return torch.randint(0, 2, meta.shape, generator=gen, dtype=meta.dtype)


def _concrete(call: OpCall, tensors: list[torch.Tensor]) -> tuple[tuple, dict]:
    leaves, tree = _compat.tree_flatten((call.args, call.kwargs))
    leaves = [tensors[x.index] if isinstance(x, TensorArg) else x for x in leaves]
    return _compat.tree_unflatten(leaves, tree)


def _outputs(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not want.dtype.is_floating_point or want.numel() == 0:
        return torch.equal(got, want)
    return torch.allclose(got.double(), want.double(), rtol=1e-5, atol=1e-6 * max(1.0, want.abs().max().item()),
                          equal_nan=True)


class _Trial:
    """One draw of random inputs with the op's unsharded result."""

    def __init__(self, call: OpCall, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.tensors = [_random(m, gen) for m in call.inputs]
        args, kwargs = _concrete(call, [t.clone() for t in self.tensors])
        self.args, self.kwargs = _concrete(call, self.tensors)
        self.expected = _outputs(call.target(*args, **kwargs))


def _discover(call: OpCall) -> Optional[tuple[AxisRule, ...]]:
    try:
        trials = [_Trial(call, seed) for seed in SEEDS]
        again = _Trial(call, SEEDS[0])
    except Exception:  # noqa: BLE001 - the op does not run on random data: nothing to learn
        return None
    if not all(_same(a, b) for a, b in zip(again.expected, trials[0].expected)):
        return None  # random op
    if len(trials[0].expected) != len(call.outputs):
        return None
    found = [AxisRule((R,) * len(call.inputs), (R,) * len(call.outputs))]
    out_choices = [output_options(m) for m in call.outputs]
    for ins in input_patterns(call):
        found += [AxisRule(ins, tuple(outs)) for outs in product(*_holding_outputs(call, trials, ins, out_choices))]
    return tuple(found)


def _holding_outputs(call: OpCall, trials: list[_Trial], ins: tuple[Placement, ...],
                     out_choices: list[list[Placement]]) -> list[list[Placement]]:
    """For each output, the placements under which it reassembles to the op's result
    when the inputs are laid out as `ins` (step 2's tests): the op runs shard by shard once
    per draw and shard count, and each output's layouts are checked on those blocks (a rule holds when every output does, so the product of these lists
    is exactly the rules that hold, in the order of product(*out_choices))."""
    holding = [list(c) for c in out_choices]
    none: list[list[Placement]] = [[] for _ in out_choices]
    for n in SHARD_COUNTS:
        in_specs = tuple(Spec((p,), m) for p, m in zip(ins, call.inputs))
        if not all(s.fits((n,)) for s in in_specs):
            if n == SHARD_COUNTS[0]:
                return none  # does not even divide in two
            continue
        strategy = Strategy(in_specs, tuple(Spec((R,), m) for m in call.outputs))
        for trial in trials:
            args = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in trial.args)
            try:
                blocks = run_blocks(call.target, args, trial.kwargs, strategy, (n,), seed=n)
            except Exception:  # noqa: BLE001 - an input layout the op cannot run shard by shard
                return none
            if len(blocks) != len(trial.expected):
                return none
            holding = [[p for p in options if _reassembles(b, Spec((p,), meta), n, want, first=n == SHARD_COUNTS[0])]
                       for options, b, meta, want in zip(holding, blocks, call.outputs, trial.expected)]
    return holding


def _reassembles(blocks: dict, spec: Spec, n: int, want: torch.Tensor, first: bool) -> bool:
    if not spec.fits((n,)):
        return not first  # an output split that does not divide in two never holds; in four it is not tried
    try:
        return _same(assemble(blocks, spec, (n,)), want)
    except Exception:  # noqa: BLE001 - replicas that disagree
        return False
