"""The straightforward torch baseline the codec is measured against.

This is the codec as a competent engineer would first write it with plain torch ops, in the
format of the production system (12-bit indices, one byte per 2-bit code):

- encode: tile each tensor (reshape / permute / contiguous), ``torch.topk`` of the magnitudes per
  tile (default, sorted by value), gather the signed values, quantise them with the DESIGN.md
  2-bit quantiser in fp32 torch ops, pack the within-tile positions at 12 bits (two positions in
  three bytes), store each code in a whole byte, and rebuild the dense reconstruction by
  scattering into a zero tile-layout tensor and permuting back;
- decode + aggregate (the production system's path): parse every peer (unpack the 12-bit
  positions, codes to values through the levels), scale each peer's values of a tensor by its
  median-norm clipping factor (``torch.norm`` of the values, as
  ``node.compute.outer.clip_scales``), concatenate the peers along the tile and average with one
  ``scatter_reduce_(reduce="mean", include_self=False)`` per tensor; untile, and apply.

Per tensor, the byte layout is ``shift`` and the four levels (20 bytes of fp32, the same as
ours), then the 12-bit positions (``3 * ceil(n_kept / 2)`` bytes), then ``n_kept`` code bytes;
tensors follow each other in sorted name order, so the sizes follow from the shapes alone.
It computes what ``protocol.codec`` + ``node.compute.outer`` compute (``tests/test_bench_naive.py``
checks it); only the speed, size and memory differ.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from protocol.tiles import TileGeometry

_STATS = struct.Struct("<5f")


@dataclass(frozen=True)
class NaiveSparse:
    """One tensor of a parsed baseline payload."""

    geometry: TileGeometry
    positions: torch.Tensor  # (n_tiles, k) int64 positions inside each tile, in topk order
    codes: torch.Tensor  # (n_tiles * k,) uint8 in [0, 3]
    table: torch.Tensor  # (4,) fp32 dequantised value of each code

    def values(self) -> torch.Tensor:
        """The dequantised kept values, shaped like ``positions``."""
        return self.table[self.codes.long()].view(self.positions.shape)


def record_size(geometry: TileGeometry) -> int:
    """Bytes of one tensor's record: stats, 12-bit positions, one byte per code."""
    n = geometry.n_kept
    return _STATS.size + 3 * ((n + 1) // 2) + n


def _geometry(shape: tuple[int, ...], topk: int, tile: int) -> TileGeometry:
    geometry = TileGeometry.of(tuple(shape), topk=topk, tile=tile)
    if geometry.tile_len > 4096 or geometry.n_tiles == 0:
        raise ValueError(f"the 12-bit baseline needs non-empty tiles of <= 4096, got {shape}")
    return geometry


def tile(x: torch.Tensor, g: TileGeometry) -> torch.Tensor:
    """``x`` as a contiguous ``(n_tiles, tile_len)`` matrix."""
    gr, gc = g.grid
    return x.reshape(gr, g.h, gc, g.w).permute(0, 2, 1, 3).contiguous().view(g.n_tiles, -1)


def untile(t: torch.Tensor, g: TileGeometry) -> torch.Tensor:
    """Inverse of ``tile``."""
    gr, gc = g.grid
    return t.view(gr, gc, g.h, g.w).permute(0, 2, 1, 3).reshape(g.shape)


def quantize(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DESIGN.md's 2-bit quantiser in fp32: ``(shift, levels, codes)``."""
    shift = v.mean()
    c = v - shift
    # 6 * sigma / 4 with the unbiased sigma, undefined (so 1 below) for a single value
    scale = c.std() * 1.5 if c.numel() > 1 else torch.tensor(float("nan"))
    if not bool(torch.isfinite(scale)) or float(scale) == 0.0:
        scale = torch.tensor(1.0)
    codes = torch.clamp(torch.round(c / scale + 2.0), 0, 3).long()  # round half to even
    sums = torch.zeros(4).index_add_(0, codes, c)
    counts = torch.bincount(codes, minlength=4).clamp(min=1)
    return shift, sums / counts, codes.to(torch.uint8)


def pack12(idx: torch.Tensor) -> bytes:
    """Values < 4096, two to three bytes (big-endian nibbles), zero padded to an even count."""
    v = idx.reshape(-1).to(torch.int32)
    if v.numel() % 2:
        v = torch.cat([v, v.new_zeros(1)])
    a, b = v[0::2], v[1::2]
    out = torch.stack([a >> 4, ((a & 15) << 4) | (b >> 8), b & 255], dim=1)
    return out.to(torch.uint8).numpy().tobytes()


def unpack12(data: bytes, count: int) -> torch.Tensor:
    """Inverse of ``pack12`` as int64."""
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).long().view(-1, 3)
    a = (raw[:, 0] << 4) | (raw[:, 1] >> 4)
    b = ((raw[:, 1] & 15) << 8) | raw[:, 2]
    return torch.stack([a, b], dim=1).view(-1)[:count]


def encode(
    tensors: Mapping[str, torch.Tensor], *, topk: int = 64, tile_size: int = 64
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Compress every tensor; returns the payload and the dense fp32 reconstruction."""
    parts: list[bytes] = []
    recon: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        x = tensors[name].detach().float()
        g = _geometry(tuple(x.shape), topk, tile_size)
        tiles = tile(x, g)
        _, idx = torch.topk(tiles.abs(), g.k, dim=1)
        vals = torch.gather(tiles, 1, idx)
        shift, levels, codes = quantize(vals.reshape(-1))
        table = levels + shift
        dense = torch.zeros_like(tiles).scatter_(1, idx, table[codes.long()].view_as(idx))
        recon[name] = untile(dense, g)
        parts.append(_STATS.pack(float(shift), *levels.tolist()))
        parts.append(pack12(idx))
        parts.append(codes.numpy().tobytes())
    return b"".join(parts), recon


def read(
    data: bytes, shapes: Mapping[str, tuple[int, ...]], *, topk: int = 64, tile_size: int = 64
) -> dict[str, NaiveSparse]:
    """Parse a baseline payload for a model of ``shapes`` (lengths only are checked)."""
    out: dict[str, NaiveSparse] = {}
    offset = 0
    for name in sorted(shapes):
        g = _geometry(tuple(shapes[name]), topk, tile_size)
        n = g.n_kept
        if offset + record_size(g) > len(data):
            raise ValueError(f"baseline payload too short at tensor {name!r}")
        shift, *levels = _STATS.unpack_from(data, offset)
        offset += _STATS.size
        idx_len = 3 * ((n + 1) // 2)
        positions = unpack12(data[offset : offset + idx_len], n).view(g.n_tiles, g.k)
        offset += idx_len
        codes = torch.frombuffer(bytearray(data[offset : offset + n]), dtype=torch.uint8)
        offset += n
        table = torch.tensor(levels, dtype=torch.float32) + torch.tensor(shift)
        out[name] = NaiveSparse(g, positions, codes, table)
    if offset != len(data):
        raise ValueError("trailing bytes after the baseline payload")
    return out


def clip_scales(parts: Sequence[NaiveSparse]) -> torch.Tensor:
    """Per-peer ``min(1, median_norm / norm)`` (1 for a zero norm), fp32."""
    norms = torch.stack([p.values().norm() for p in parts])
    median = torch.quantile(norms, 0.5)
    return torch.where(norms > median, median / norms, torch.ones_like(norms))


def aggregate(
    peers: Sequence[Mapping[str, NaiveSparse]], *, clip: bool = True
) -> dict[str, torch.Tensor]:
    """Scatter-mean over peers of every tensor, as the production path does it.

    Per tensor: every peer's values (scaled by its clipping factor) and tile positions are
    concatenated along the tile, then one ``scatter_reduce_(..., "mean", include_self=False)``
    into a zero tile-layout tensor averages each coordinate over the peers that sent it (0
    where nobody did); the result is untiled. The whole model's aggregate is built before any of
    it is applied, as an optimiser step over gradients would need.
    """
    out = {}
    for n in sorted(peers[0]):
        parts = [p[n] for p in peers]
        g = parts[0].geometry
        scales = clip_scales(parts) if clip else torch.ones(len(parts))
        index = torch.cat([t.positions for t in parts], dim=1)
        values = torch.cat([t.values() * scales[i] for i, t in enumerate(parts)], dim=1)
        mean = torch.zeros(g.n_tiles, g.tile_len).scatter_reduce_(
            1, index, values, reduce="mean", include_self=False
        )
        out[n] = untile(mean, g)
    return out


def apply(
    params: Mapping[str, torch.Tensor],
    payloads: Sequence[bytes],
    *,
    topk: int = 64,
    tile_size: int = 64,
    alpha: float = 1.0,
    clip: bool = True,
) -> None:
    """Parse every payload, aggregate and do ``theta -= alpha * aggregate`` in place."""
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    peers = [read(d, shapes, topk=topk, tile_size=tile_size) for d in payloads]
    update = aggregate(peers, clip=clip)
    with torch.no_grad():
        for name, theta in params.items():
            theta.sub_(update[name] * alpha)
