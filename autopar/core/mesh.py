"""Mesh shapes and the row-major rank <-> coordinate map."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from autopar.core.errors import MeshError


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

    def __str__(self) -> str:
        return "x".join(str(s) for s in self.shape)
