"""Tile geometry: how a tensor is cut into the chunks whose Top-k entries are sent.

Per DESIGN.md, a tensor is never flattened before chunking. It is viewed as a matrix
``(rows, cols)``: a 2-D tensor as itself, a tensor of more dimensions as ``(shape[0], rest)``,
a 1-D tensor as ``(1, n)`` and a scalar as ``(1, 1)``. The matrix is cut into ``h x w`` tiles,
``h`` the largest divisor of ``rows`` not above the tile target and ``w`` likewise for ``cols``
(so a 1-D tensor becomes runs of ``w`` elements). Each tile is flattened row-major: position
``r * w + c``. Tiles are numbered row-major over the tile grid.

The *tile-major* layout, a ``(n_tiles, h * w)`` matrix, is what Top-k and aggregation work on;
``to_tiles`` and ``from_tiles`` convert between it and the tensor's own layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import prod

import torch

from protocol.errors import CodecError

#: Largest tile target (edge length) the format accepts; keeps positions inside int32 easily.
MAX_TILE = 1024


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is ``<= cap`` (1 for n <= 1)."""
    if n <= 1:
        return 1
    for d in range(min(n, cap), 0, -1):
        if n % d == 0:
            return d
    return 1  # unreachable: 1 divides everything


def k_per_tile(tile_len: int, topk: int, tile: int) -> int:
    """Kept entries per tile: ``max(1, round(tile_len * topk / tile**2))``, halves to even.

    Computed on an exact fraction so the half-even rule holds for any tile target, not just
    powers of two.
    """
    return max(1, round(Fraction(tile_len * topk, tile * tile)))


def check_codec_params(topk: int, tile: int) -> None:
    """Raise ``CodecError`` unless ``1 <= tile <= MAX_TILE`` and ``1 <= topk <= tile**2``."""
    if isinstance(tile, bool) or not isinstance(tile, int) or not 1 <= tile <= MAX_TILE:
        raise CodecError(f"tile must be an int in [1, {MAX_TILE}], got {tile!r}")
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= tile * tile:
        raise CodecError(f"topk must be an int in [1, tile**2 = {tile * tile}], got {topk!r}")


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The ``(rows, cols)`` matrix view of a tensor shape (see module docstring)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], prod(shape[1:])


@dataclass(frozen=True)
class TileGeometry:
    """How one tensor is tiled, and how many entries each tile keeps."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    h: int
    w: int
    k: int

    @classmethod
    def of(cls, shape: tuple[int, ...], *, topk: int, tile: int) -> TileGeometry:
        """Geometry of a tensor of ``shape`` for codec parameters ``topk`` and ``tile``."""
        rows, cols = matrix_shape(shape)
        h = largest_divisor_at_most(rows, tile)
        w = largest_divisor_at_most(cols, tile)
        return cls(tuple(shape), rows, cols, h, w, k_per_tile(h * w, topk, tile))

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def tile_len(self) -> int:
        return self.h * self.w

    @property
    def grid(self) -> tuple[int, int]:
        """Tiles per column and per row of the tile grid."""
        return (self.rows // self.h if self.h else 0), (self.cols // self.w if self.w else 0)

    @property
    def n_tiles(self) -> int:
        if self.numel == 0:
            return 0
        gr, gc = self.grid
        return gr * gc

    @property
    def n_kept(self) -> int:
        return self.n_tiles * self.k

    def flat_index(self, positions: torch.Tensor) -> torch.Tensor:
        """Row-major indices into the flattened tensor of ``(n_tiles, k)`` tile positions."""
        _, gc = self.grid
        tile_id = torch.arange(self.n_tiles, dtype=torch.int64)
        # Flat index of each tile's top-left element, then the offset of each position in it.
        origin = (tile_id // gc) * (self.h * self.cols) + (tile_id % gc) * self.w
        pos = positions.to(torch.int64)
        r = pos // self.w
        return (origin.unsqueeze(1) + r * self.cols + (pos - r * self.w)).reshape(-1)
