"""Placements and tensor specs: plain, frozen, hashable data.

A placement says how one mesh axis holds a tensor; a Spec is one placement per mesh
axis plus the tensor's global shape and dtype. Nothing here runs a collective.

    R      every rank on the axis holds the whole tensor
    S(d)   the tensor is split in chunks along dim d across the axis, as torch.chunk
           cuts it: blocks of ceil(n / k), the last ones shorter where k does not divide n
    P      every rank holds a summand; the true value is their sum
    P(avg) / P(max): the true value is the mean / maximum over the axis

Several axes may shard the same dim: the earlier mesh axis is the outer split
(rank (i, j) of a (2, 4) mesh with S(0)S(0) holds chunk i * 4 + j of 8).

Uneven shards (a dim of size n on an axis of size k, n % k != 0) follow torch.chunk, as
DTensor does, so a sharded checkpoint is a DTensor one: 1001 rows over 4 ranks are
251, 251, 251, 248. They are allowed only where ONE mesh axis splits the dim (nested
blocks of blocks would not line up with per-axis gathers) and every rank keeps at least
one element (6 over 4 would leave the last rank none). Collectives pad each block to
ceil(n / k) (autopar/runtime/collectives.py); the cost model prices that largest block,
which sets the step time, so `local_shape` is the largest block and `local_shape_at` the
one a given rank holds.

A shard may carry a unit, S(d/u): the dim (n, a multiple of u) is cut between whole groups
of u elements, torch.chunk-ing the n / u groups. It is how heads split unevenly: hidden
320 = 5 heads x 64 on 2 ranks is S(d/64), columns 192 and 128 (heads 3 and 2), which
chunk(320, 2) is not. A unit is kept only where the groups do not divide the axis
(`canonical`), so every even split is S(d) as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod
from typing import Union

import torch


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Split along `dim`. `unit`: the dim is cut only between whole groups of `unit`
    elements (a head of `unit` columns), chunked as torch.chunk chunks the groups; it
    matters only for an uneven split and is 1 (printed S(d)) otherwise."""

    dim: int
    unit: int = 1

    def __str__(self) -> str:
        return f"S({self.dim})" if self.unit == 1 else f"S({self.dim}/{self.unit})"


PARTIAL_REDUCES = ("sum", "avg", "max")


@dataclass(frozen=True)
class Partial:
    reduce: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce not in PARTIAL_REDUCES:
            raise ValueError(f"Partial reduce must be one of {PARTIAL_REDUCES}, got {self.reduce!r}")

    def __str__(self) -> str:
        return "P" if self.reduce == "sum" else f"P({self.reduce})"


Placement = Union[Replicate, Shard, Partial]
R = Replicate()
P = Partial()


def parse_placement(text: str) -> Placement:
    """Inverse of str(placement): 'R', 'S(2)', 'S(2/64)', 'P', 'P(avg)'."""
    if text == "R":
        return R
    if text == "P":
        return P
    if text.startswith("S(") and text.endswith(")"):
        dim, _, unit = text[2:-1].partition("/")
        if unit and int(unit) < 1:
            raise ValueError(f"not a placement: {text!r} (a shard's unit is a positive int)")
        return Shard(int(dim), int(unit) if unit else 1)
    if text.startswith("P(") and text.endswith(")"):
        return Partial(text[2:-1])
    raise ValueError(f"not a placement: {text!r} (expected R, S(d), S(d/unit), P or P(avg|max))")


def parse_placements(text: str) -> tuple[Placement, ...]:
    """Inverse of str(spec): 'S(0)R' -> (Shard(0), R); 'RS(2/64)' -> (R, Shard(2, 64))."""
    tokens = re.findall(r"S\(\d+(?:/\d+)?\)|P\(\w+\)|P|R", text)
    if "".join(tokens) != text:
        raise ValueError(f"not a placement string: {text!r} (expected e.g. 'S(0)R' or 'PS(1)')")
    return tuple(parse_placement(t) for t in tokens)


@dataclass(frozen=True)
class TensorMeta:
    """Global shape and dtype of one tensor of the traced graph."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize

    @staticmethod
    def of(t: torch.Tensor) -> "TensorMeta":
        return TensorMeta(tuple(size_hint(s) for s in t.shape), t.dtype)


def size_hint(size: "int | torch.SymInt") -> int:
    """An int size, or the hint of a symbolic one (the size the trace was made at, which
    the planner prices). Never int() of a SymInt: that guards on its value and turns the
    symbol into that constant for every later reader of the trace's shape env."""
    if isinstance(size, torch.SymInt):
        node = size.node
        if node.hint is not None:
            return int(node.hint)
        return int(node.shape_env.size_hint(node.expr))
    return int(size)


@dataclass(frozen=True)
class Spec:
    """How a tensor lives on the mesh: one placement per mesh axis."""

    placements: tuple[Placement, ...]
    meta: TensorMeta

    def __str__(self) -> str:
        return "".join(str(p) for p in self.placements)

    def shard_axes(self, dim: int) -> tuple[int, ...]:
        """Mesh axes that split `dim`, outermost first."""
        return tuple(a for a, p in enumerate(self.placements) if type(p) is Shard and p.dim == dim)

    def is_replicated(self) -> bool:
        return all(p == R for p in self.placements)

    def local_shape(self, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        return local_shape(self.placements, self.meta.shape, mesh_shape)

    def local_nbytes(self, mesh_shape: tuple[int, ...]) -> int:
        return prod(self.local_shape(mesh_shape)) * self.meta.dtype.itemsize

    def local_shape_at(self, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> tuple[int, ...]:
        """The block the rank at `coords` holds (shorter than local_shape on a short last block)."""
        return tuple(s.stop - s.start for s in block_index(self, mesh_shape, coords))

    def fits(self, mesh_shape: tuple[int, ...], uneven: bool = False) -> bool:
        """True when every sharded dim divides evenly over the axes that split it, or,
        with `uneven`, is split by one axis into chunks that leave no rank empty."""
        if len(self.placements) != len(mesh_shape):
            return False
        shape = self.meta.shape
        ways: dict[int, int] = {}  # sharded dim -> the ranks that split it
        axes: dict[int, int] = {}  # sharded dim -> how many mesh axes (of size > 1) split it
        units: dict[int, int] = {}  # sharded dim -> the largest unit it is cut in
        for a, p in enumerate(self.placements):
            if type(p) is Shard:
                if not 0 <= p.dim < len(shape) or shape[p.dim] % p.unit != 0:
                    return False
                ways[p.dim] = ways.get(p.dim, 1) * mesh_shape[a]
                axes[p.dim] = axes.get(p.dim, 0) + (mesh_shape[a] > 1)
                units[p.dim] = max(units.get(p.dim, 1), p.unit)
        return all(w <= 1 or (units[d] == 1 and shape[d] % w == 0 and shape[d] >= w)
                   or (uneven and axes[d] == 1 and no_empty_block(shape[d] // units[d], w))
                   for d, w in ways.items())

    def uneven_axes(self, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Mesh axes whose shard of this tensor has a short last block."""
        return tuple(a for a, p in enumerate(self.placements)
                     if type(p) is Shard and units_of(self.meta.shape[p.dim], p) % mesh_shape[a] != 0)


def local_shape(placements: tuple[Placement, ...], shape: tuple[int, ...], mesh_shape: tuple[int, ...]
                ) -> tuple[int, ...]:
    """The shape each rank holds of a tensor of global `shape` under `placements`; for an
    uneven shard, the largest block (what memory and time are priced at)."""
    out = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            out[p.dim] = largest_block(out[p.dim], mesh_shape[axis], p.unit)
    return tuple(out)


def units_of(n: int, p: Shard) -> int:
    """How many whole units a dim of size n is cut between."""
    return n // p.unit


def largest_block(n: int, k: int, unit: int = 1) -> int:
    """torch.chunk's block of n elements over k ranks (in whole groups of `unit`): every
    block but the last ones; what a padded collective moves per rank."""
    return -(-n // (k * unit)) * unit


def chunk_sizes(n: int, k: int, unit: int = 1) -> tuple[int, ...]:
    """Block sizes of torch.chunk(n elements, k) padded to k blocks (0 where chunk gives fewer):
    chunk_sizes(1001, 4) == (251, 251, 251, 248), chunk_sizes(6, 4) == (2, 2, 2, 0). With a
    unit, the n / unit units are chunked: chunk_sizes(80, 2, 16) == (48, 32) (5 heads: 3, 2)."""
    step = largest_block(n, k, unit)
    return tuple(max(0, min(step, n - i * step)) for i in range(k))


def split_blocks(t: torch.Tensor, k: int, dim: int, unit: int = 1) -> tuple[torch.Tensor, ...]:
    """t cut along dim into the k blocks of chunk_sizes: torch.chunk's when unit is 1, and
    empty blocks after them where the dim is too short for k (2 rows over 4: 1, 1, 0, 0)."""
    if unit == 1:
        blocks = t.chunk(k, dim=dim)
        return tuple(blocks) + (t.narrow(dim, t.shape[dim], 0),) * (k - len(blocks))
    return tuple(t.split(list(chunk_sizes(t.shape[dim], k, unit)), dim=dim))


def canonical(placements: tuple[Placement, ...], shape: tuple[int, ...], mesh_shape: tuple[int, ...]
              ) -> tuple[Placement, ...]:
    """Placements with a unit dropped where it does not change the blocks (the dim's units
    divide evenly over all the axes that split it), so an even split is always spelled
    S(d) and plans and digests read as before units existed."""
    ways: dict[int, int] = {}
    for a, p in enumerate(placements):
        if type(p) is Shard:
            ways[p.dim] = ways.get(p.dim, 1) * mesh_shape[a]
    return tuple(Shard(p.dim) if type(p) is Shard and p.unit != 1 and p.dim < len(shape)
                 and shape[p.dim] % (p.unit * ways[p.dim]) == 0 else p for p in placements)


def no_empty_block(n: int, k: int) -> bool:
    """True when every one of k ranks holds at least one of n elements under chunking."""
    return n >= k and (k - 1) * largest_block(n, k) < n


def replicated(meta: TensorMeta, mesh_ndim: int) -> Spec:
    return Spec((R,) * mesh_ndim, meta)


def chunk_of(spec: Spec, dim: int, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> tuple[int, int, int]:
    """(which chunk, of how many, in units of) `dim` the rank at `coords` holds."""
    chunk, ways, unit = 0, 1, 1
    for a in spec.shard_axes(dim):  # outermost first
        chunk, ways = chunk * mesh_shape[a] + coords[a], ways * mesh_shape[a]
        unit = max(unit, spec.placements[a].unit)  # type: ignore[union-attr]
    return chunk, ways, unit


def block_index(spec: Spec, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> tuple[slice, ...]:
    """Index of the block the rank at `coords` holds: full[block_index(...)] == its shard.
    Lets a loader read just that slice of a tensor from a file."""
    index = []
    for d, size in enumerate(spec.meta.shape):
        chunk, ways, unit = chunk_of(spec, d, mesh_shape, coords)
        step = largest_block(size, ways, unit)  # torch.chunk's block: the last ones may be short
        index.append(slice(min(chunk * step, size), min((chunk + 1) * step, size)))
    return tuple(index)


def local_chunk(t: torch.Tensor, spec: Spec, mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> torch.Tensor:
    """The block of the full tensor `t` that the rank at `coords` holds under `spec`.

    Partial placements keep the full value on coordinate 0 and zeros elsewhere (a
    valid summand decomposition); inputs and parameters are never partial in practice.
    """
    out = t
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            out = split_blocks(out, mesh_shape[axis], p.dim, p.unit)[coords[axis]]
        elif isinstance(p, Partial) and p.reduce == "sum" and coords[axis] != 0:
            out = torch.zeros_like(out)
    return out
