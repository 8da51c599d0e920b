"""A read payload in sparse form: what aggregation consumes instead of dense tensors.

``SparseTensor`` is one tensor of a validated payload (flat indices, 2-bit codes and the
four-value table); ``Payload`` is the header's fields and the tensors that were read. Both come
out of ``protocol.payload_reader`` and are re-exported by ``protocol.codec``, where callers
import them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from protocol.payload_index import PayloadHeader
from protocol.quantize import count_codes
from protocol.tiles import TileGeometry


@dataclass(frozen=True)
class SparseTensor:
    """One tensor of a decoded payload: where its kept values are, their codes, the value table.

    ``index`` holds the row-major indices into the flattened tensor, in the payload's order
    (tile by tile, ascending position inside each tile): exactly what aggregation scatters to.
    """

    name: str
    geometry: TileGeometry
    index: torch.Tensor  # (n_tiles * k,) int32 (int64 for tensors of 2**31 elements or more)
    codes: torch.Tensor  # (n_tiles * k,) uint8 in [0, 3]
    table: torch.Tensor  # (4,) fp32: the dequantised value of each code

    @property
    def positions(self) -> torch.Tensor:
        """Kept positions inside each tile, ``(n_tiles, k)`` ascending (int64)."""
        g = self.geometry
        idx = self.index.to(torch.int64)
        row, col = idx // g.cols, idx % g.cols
        return ((row % g.h) * g.w + col % g.w).view(g.n_tiles, g.k)

    def values(self) -> torch.Tensor:
        """The dequantised kept values, in the order of ``index``."""
        return self.table[self.codes.to(torch.int64)]

    def code_counts(self) -> list[int]:
        """How many kept values carry each of the four codes."""
        # A compiled count (nogil): torch's bincount cost about 50x more here.
        return [int(c) for c in count_codes(self.codes.numpy())]

    def sq_norm(self) -> float:
        """Exact squared L2 norm of the dequantised tensor, computed the same way everywhere.

        A tensor holds only four distinct values, so the norm is a four-term sum in float64:
        independent of thread count, SIMD width and summation order.
        """
        table = [float(v) for v in self.table]
        return math.fsum(n * v * v for n, v in zip(self.code_counts(), table, strict=True))

    def dense(self) -> torch.Tensor:
        """The dense fp32 tensor this sparse tensor stands for."""
        out = torch.zeros(self.geometry.numel, dtype=torch.float32)
        out[self.index.to(torch.int64)] = self.values()
        return out.view(self.geometry.shape)


@dataclass(frozen=True)
class Payload(PayloadHeader):
    """A validated payload: its header fields and the tensors that were read, sparse.

    ``tensors`` holds every tensor of the model, or exactly those a partial read asked for
    (``read_payload(..., only=...)``). It is a plain dict, or (``lazy=True``) a mapping that
    decodes a tensor each time it is looked up, so a consumer going tensor by tensor holds one
    decoded tensor per payload at a time.
    """

    tensors: Mapping[str, SparseTensor]
