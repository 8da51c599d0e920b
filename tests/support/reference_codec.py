"""A slow, obvious reference of the SparseLoCo codec, written from DESIGN.md's text alone.

Nothing here imports ``protocol``: tile geometry, per-tile k, Top-k selection, the 2-bit
quantiser and the dense reconstruction are re-derived with plain Python loops and lists, so
the tests can compare the real (vectorised) codec against an independent reading of the spec.
Use it on small tensors only.

- Tiles: a tensor is viewed as a matrix ``(rows, cols)``: 2-D as itself, more dimensions as
  ``(shape[0], prod(rest))``, 1-D as ``(1, n)``, a scalar as ``(1, 1)``. Tiles are ``h x w``
  with ``h`` the largest divisor of ``rows`` that is ``<= tile`` and ``w`` likewise for ``cols``;
  tiles are numbered row-major over the grid and flattened row-major inside (``r * w + c``).
- k per tile: ``max(1, round(tile_len * topk / tile**2))``, halves to even.
- Top-k: the ``k`` largest magnitudes of each tile, ties to the lower position.
- Quantiser (per tensor, over all kept values, in float64): ``shift`` = mean, ``c = v - shift``,
  ``sigma`` = unbiased std of ``c``, ``scale = 6 sigma / 4`` (1 if zero, not finite, or n == 1),
  ``code = clamp(round_half_even(c / scale + 2), 0, 3)``, ``level[j]`` = mean of ``c`` over code
  ``j`` (0 if empty); shift and levels are rounded to fp32 and the dequantised value is
  ``fp32(level) + fp32(shift)`` computed in fp32.

The wire helpers at the end (``split_payload``, ``build_payload``, ``rice_streams``,
``decode_positions``, ``pack_codes``) follow the payload format of DESIGN.md and
``protocol/envelope.py``'s layout table; tests use them to read payloads independently and to
craft malformed ones.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import zstandard


def fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 value (as a Python float); overflow gives +-inf."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def largest_divisor(n: int, cap: int) -> int:
    """The largest ``d`` with ``d | n`` and ``d <= cap`` (1 when ``n <= 1``)."""
    best = 1
    for d in range(1, min(n, cap) + 1):
        if n % d == 0:
            best = d
    return best


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    rest = 1
    for d in shape[1:]:
        rest *= d
    return shape[0], rest


def round_half_even_ratio(num: int, den: int) -> int:
    """``num / den`` (non-negative integers) rounded to the nearest integer, halves to even."""
    q, r = divmod(num, den)
    if 2 * r > den or (2 * r == den and q % 2 == 1):
        q += 1
    return q


def k_per_tile(tile_len: int, topk: int, tile: int) -> int:
    return max(1, round_half_even_ratio(tile_len * topk, tile * tile))


@dataclass(frozen=True)
class RefGeometry:
    shape: tuple[int, ...]
    rows: int
    cols: int
    h: int
    w: int
    k: int

    @property
    def tile_len(self) -> int:
        return self.h * self.w

    @property
    def n_tiles(self) -> int:
        if self.rows * self.cols == 0:
            return 0
        return (self.rows // self.h) * (self.cols // self.w)

    def tile_flat_indices(self) -> list[list[int]]:
        """For each tile (row-major over the grid), the row-major flat index of each position."""
        out: list[list[int]] = []
        if self.n_tiles == 0:
            return out
        for ti in range(self.rows // self.h):
            for tj in range(self.cols // self.w):
                idx = []
                for r in range(self.h):
                    for c in range(self.w):
                        idx.append((ti * self.h + r) * self.cols + tj * self.w + c)
                out.append(idx)
        return out


def geometry(shape: tuple[int, ...], *, topk: int, tile: int) -> RefGeometry:
    rows, cols = matrix_view(tuple(shape))
    h = largest_divisor(rows, tile)
    w = largest_divisor(cols, tile)
    return RefGeometry(tuple(shape), rows, cols, h, w, k_per_tile(h * w, topk, tile))


def top_k_positions(values: list[float], k: int) -> list[int]:
    """Ascending positions of the ``k`` largest ``|values|``, ties to the lower position."""
    order = sorted(range(len(values)), key=lambda p: (-abs(values[p]), p))
    return sorted(order[:k])


@dataclass(frozen=True)
class RefQuantized:
    shift: float  # fp32-representable
    levels: tuple[float, float, float, float]  # fp32-representable
    codes: list[int]
    ratios: list[float]  # c / scale + 2 before rounding, to spot values on a .5 boundary
    table: tuple[float, float, float, float]  # fp32(level) + fp32(shift) in fp32


def quantize(values: list[float], codes: list[int] | None = None) -> RefQuantized:
    """The reference quantiser. ``codes``, when given, replaces the computed codes when the
    levels are formed (to compare levels even where a value sits on a rounding boundary)."""
    n = len(values)
    if n == 0:
        return RefQuantized(0.0, (0.0, 0.0, 0.0, 0.0), [], [], (0.0, 0.0, 0.0, 0.0))
    shift = math.fsum(values) / n
    c = [v - shift for v in values]
    if n > 1:
        mean_c = math.fsum(c) / n
        sigma = math.sqrt(math.fsum((x - mean_c) ** 2 for x in c) / (n - 1))
    else:
        sigma = math.nan
    scale = 6.0 * sigma / 4.0
    if not math.isfinite(scale) or scale == 0.0:
        scale = 1.0
    ratios = [x / scale + 2.0 for x in c]
    if codes is None:
        codes = [min(3, max(0, round(t))) for t in ratios]  # Python's round: half to even
    levels = []
    for j in range(4):
        members = [x for x, code in zip(c, codes, strict=True) if code == j]
        levels.append(fp32(math.fsum(members) / len(members)) if members else 0.0)
    s32 = np.float32(fp32(shift))
    with np.errstate(over="ignore"):
        table = tuple(float(np.float32(lv) + s32) for lv in levels)
    return RefQuantized(
        fp32(shift),
        (levels[0], levels[1], levels[2], levels[3]),
        codes,
        ratios,
        (table[0], table[1], table[2], table[3]),
    )


@dataclass(frozen=True)
class RefEncoded:
    """The reference's view of one encoded tensor."""

    geometry: RefGeometry
    positions: list[list[int]]  # per tile, ascending
    values: list[float]  # kept values, tile-major, ascending position inside a tile
    quantized: RefQuantized
    recon: torch.Tensor  # dense fp32, the input's shape


def encode_tensor(x: torch.Tensor, *, topk: int, tile: int) -> RefEncoded:
    """Reference compression of one tensor (plain loops; small tensors only)."""
    g = geometry(tuple(x.shape), topk=topk, tile=tile)
    flat = [float(v) for v in x.detach().to(torch.float32).reshape(-1).tolist()]
    positions: list[list[int]] = []
    values: list[float] = []
    flat_kept: list[int] = []
    for idx in g.tile_flat_indices():
        tile_vals = [flat[i] for i in idx]
        pos = top_k_positions(tile_vals, g.k)
        positions.append(pos)
        values.extend(tile_vals[p] for p in pos)
        flat_kept.extend(idx[p] for p in pos)
    q = quantize(values)
    dense = [0.0] * len(flat)
    for i, code in zip(flat_kept, q.codes, strict=True):
        dense[i] = q.table[code]
    recon = torch.tensor(dense, dtype=torch.float32).reshape(x.shape)
    return RefEncoded(g, positions, values, q, recon)


def stats_bytes(shift: float, levels: tuple[float, ...]) -> bytes:
    """The 20-byte statistics block: shift then the four levels, little-endian fp32."""
    return struct.pack("<5f", shift, *levels)


def read_bits(data: bytes) -> list[int]:
    """Every bit of ``data``, most significant first within each byte."""
    return [(byte >> (7 - i)) & 1 for byte in data for i in range(8)]


def decode_positions(
    rice_bits: int, unary: bytes, remainders: bytes, *, n_tiles: int, k: int
) -> list[list[int]]:
    """Reference Rice decoder (no validation): quotients in unary (zeros then a one), remainders
    as fixed ``rice_bits``-bit fields, gaps ``g_0 = p_0`` and ``g_j = p_j - p_{j-1} - 1``."""
    ubits, rbits = read_bits(unary), read_bits(remainders)
    quotients, q = [], 0
    for bit in ubits:
        if bit:
            quotients.append(q)
            q = 0
        else:
            q += 1
    out, at = [], 0
    for t in range(n_tiles):
        pos, prev = [], -1
        for j in range(k):
            r = 0
            for _ in range(rice_bits):
                r = (r << 1) | rbits[at]
                at += 1
            gap = (quotients[t * k + j] << rice_bits) | r
            prev = prev + gap + 1
            pos.append(prev)
        out.append(pos)
    return out


# --------------------------------------------------------------------------- wire helpers

MAGIC = b"SLCP"
HEADER = struct.Struct("<4sBBI")  # magic, version, flags, CRC-32 of the stored body
RECORD_FIELDS = ("name", "shape", "rice_bits", "stats", "codes", "unary", "remainders")


def pack_bits(bits: list[int]) -> bytes:
    """Bits, most significant first within each byte, the last byte padded with zeros."""
    out = bytearray()
    for i in range(0, len(bits), 8):
        chunk = bits[i : i + 8] + [0] * (8 - len(bits[i : i + 8]))
        out.append(sum(bit << (7 - j) for j, bit in enumerate(chunk)))
    return bytes(out)


def pack_codes(codes: list[int]) -> bytes:
    """2-bit codes four to a byte, the first code in the two most significant bits."""
    bits = []
    for code in codes:
        bits += [(code >> 1) & 1, code & 1]
    return pack_bits(bits)


def rice_streams(gaps: list[int], rice_bits: int) -> tuple[bytes, bytes]:
    """``(unary, remainders)`` for a flat list of gaps (no validation: any gaps may be coded)."""
    unary, rem = [], []
    for g in gaps:
        unary += [0] * (g >> rice_bits) + [1]
        rem += [(g >> (rice_bits - 1 - i)) & 1 for i in range(rice_bits)]
    return pack_bits(unary), pack_bits(rem)


def gaps_of(positions: list[list[int]]) -> list[int]:
    out = []
    for tile in positions:
        prev = -1
        for p in tile:
            out.append(p - prev - 1)
            prev = p
    return out


def split_payload(data: bytes) -> tuple[int, int, dict[str, Any]]:
    """``(version, flags, body)`` of a well-formed payload, read with the libraries directly."""
    magic, version, flags, crc = HEADER.unpack_from(data)
    assert magic == MAGIC
    body = data[HEADER.size :]
    assert zlib.crc32(body) == crc
    if flags & 1:
        body = zstandard.ZstdDecompressor().decompress(body)
    obj = msgpack.unpackb(body, raw=False)
    assert isinstance(obj, dict)
    return version, flags, obj


def build_payload(obj: Any, *, flags: int = 0, version: int = 1, raw: bytes | None = None) -> bytes:
    """A payload with a correct header around ``obj`` packed with msgpack (or around ``raw``,
    the body exactly as stored). ``flags & 1`` compresses the packed body with zstd."""
    body = raw if raw is not None else msgpack.packb(obj, use_bin_type=True)
    if raw is None and flags & 1:
        body = zstandard.ZstdCompressor(write_content_size=True).compress(body)
    return HEADER.pack(MAGIC, version, flags, zlib.crc32(body)) + body
