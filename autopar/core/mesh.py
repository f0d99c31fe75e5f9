"""Mesh shapes, the row-major rank <-> coordinate map, and where the ranks' nodes are.

Ranks are laid out node-major, as torchrun numbers them: with `nodes` nodes of
k = size // nodes ranks, rank r runs on node r // k. The mesh is row-major over the same
ranks, so on 2 nodes of 4:

    mesh (2, 4): axis 1 groups {0,1,2,3} {4,5,6,7}  -> inside a node  (intra)
                 axis 0 groups {0,4} {1,5} ...       -> across nodes   (inter)
    mesh (4, 2): axis 1 groups {0,1} {2,3} ...       -> inside a node  (intra)
                 axis 0 groups {0,2,4,6} {1,3,5,7}   -> across nodes   (inter; 0-2 is a
                                                       local hop, 2-4 is not)
An axis is intra-node only when every one of its groups lies inside one node; a group
partly inside (as axis 0 of (4, 2) above, or axis 1 of (3, 4) on 2 nodes of 6, whose
group {4,5,6,7} straddles the boundary while {0,1,2,3} does not) makes the axis inter-node:
a ring collective moves at the pace of its slowest hop.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from autopar.core.errors import MeshError
from autopar.core.links import LinkKind


@dataclass(frozen=True)
class Mesh:
    """A logical device mesh: rank r of shape (2, 4) sits at (r // 4, r % 4)."""

    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not self.shape:
            raise MeshError(f"mesh must be a non-empty tuple of axis sizes, got {self.shape!r}")
        for size in self.shape:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshError(
                    f"mesh {self.shape!r} has axis size {size!r}; every axis needs a positive int size")

    @staticmethod
    def of(shape: "Mesh | tuple[int, ...] | list[int] | int") -> "Mesh":
        if isinstance(shape, Mesh):
            return shape
        if isinstance(shape, int) and not isinstance(shape, bool):
            return Mesh((shape,))
        if isinstance(shape, str):
            return Mesh(_parsed(shape))
        try:
            return Mesh(tuple(shape))
        except TypeError:
            raise MeshError(f"mesh must be a tuple of axis sizes like (2, 4), got {shape!r}") from None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return prod(self.shape)

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for size in reversed(self.shape):
            out.append(rank % size)
            rank //= size
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        r = 0
        for c, size in zip(coords, self.shape):
            r = r * size + c
        return r

    def axis_ranks(self, rank: int, axis: int) -> tuple[int, ...]:
        """The ranks that share every coordinate with `rank` except along `axis`."""
        c = list(self.coords(rank))
        out = []
        for i in range(self.shape[axis]):
            c[axis] = i
            out.append(self.rank(tuple(c)))
        return tuple(out)

    def ranks_per_node(self, nodes: int) -> int:
        """Ranks on each of `nodes` nodes; MeshError naming the value when it does not
        divide the mesh's size (a node cannot hold part of a rank)."""
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise MeshError(f"nodes={nodes!r} is not a positive int; pass the number of machines the ranks run "
                            "on (with torchrun: its --nnodes), 1 for a single machine")
        if self.size % nodes:
            divisors = [d for d in range(1, self.size + 1) if self.size % d == 0]
            raise MeshError(f"nodes={nodes} does not divide the {self.size} ranks of mesh {self.shape}; every node "
                            f"must run the same number of ranks: pass nodes as one of {divisors}, or a mesh whose "
                            f"size is a multiple of {nodes}")
        return self.size // nodes

    def axis_crosses_nodes(self, axis: int, nodes: int) -> bool:
        """Whether any process group along `axis` spans more than one of `nodes` nodes
        (a group partly inside a node counts as crossing; see the module docstring)."""
        per_node = self.ranks_per_node(nodes)
        return any(len({r // per_node for r in self.axis_ranks(first, axis)}) > 1 for first in range(self.size))

    def link_kinds(self, nodes: int = 1) -> tuple[LinkKind, ...]:
        """The link kind of each axis on `nodes` nodes: all INTRA on one node."""
        if nodes == 1:
            return (LinkKind.INTRA,) * self.ndim
        return tuple(LinkKind.INTER if self.axis_crosses_nodes(a, nodes) else LinkKind.INTRA
                     for a in range(self.ndim))

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.shape)


def check_node_layout(mesh: Mesh, nodes: int, world: int, ranks_on_this_node: "int | None" = None) -> int:
    """Ranks per node, after checking that `mesh` on `nodes` nodes fits the process group of
    `world` ranks, `ranks_on_this_node` of them on this node where the launcher says
    (torchrun's LOCAL_WORLD_SIZE). Raises MeshError naming the value and the fix; it runs
    before any collective, so a bad layout fails on every rank alike instead of hanging."""
    if mesh.size != world:
        raise MeshError(f"mesh {mesh.shape} has {mesh.size} devices but the process group has {world} ranks; "
                        f"pick a mesh whose sizes multiply to {world}")
    per_node = mesh.ranks_per_node(nodes)
    if ranks_on_this_node is not None and ranks_on_this_node != per_node:
        raise MeshError(f"nodes={nodes} puts {per_node} ranks on each node, but the launcher runs "
                        f"{ranks_on_this_node} on this one ({world} ranks in all); pass "
                        f"nodes={max(world // max(ranks_on_this_node, 1), 1)} (the launcher's --nnodes), or launch "
                        f"{per_node} ranks per node")
    return per_node


def _parsed(text: str) -> tuple[int, ...]:
    """'2x4', '2,4', '(2, 4)' or '8' as axis sizes; anything else a MeshError."""
    parts = [p.strip() for p in text.strip().strip("()[]").replace("x", ",").replace("*", ",").split(",")]
    parts = [p for p in parts if p]
    if not parts or not all(p.isdigit() for p in parts):
        raise MeshError(f"mesh {text!r} is not a mesh shape; write its axis sizes as a tuple (2, 4) "
                        "or as text '2x4' or '2,4'")
    return tuple(int(p) for p in parts)
