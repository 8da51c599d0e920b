"""The 2-bit quantiser of the kept values, exactly as DESIGN.md specifies.

Per tensor, over all its kept values ``v`` (fp32, at least one):

- ``shift`` = mean of ``v``; ``c = v - shift``;
- ``sigma`` = unbiased standard deviation of ``c``; ``scale = 6 * sigma / 4``, or 1 when that is
  zero or not finite (a single kept value);
- ``code = clamp(round_half_even(c / scale + 2), 0, 3)``;
- ``level[j]`` = mean of ``c`` over the values with code ``j`` (0 for an empty code);
- dequantised value = ``level[code] + shift``, computed in fp32.

Statistics are computed in float64 and rounded once to fp32 for transmission, so the result does
not depend on the summation order of fp32 arithmetic. What is transmitted is ``shift`` and the
four ``levels`` as fp32 plus the codes; the receiver rebuilds the four dequantised values with
one fp32 addition each, so encoder and decoder agree bit for bit.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numba
import numpy as np
import torch

_STATS = struct.Struct("<5f")  # shift, level0..level3 as little-endian fp32


@dataclass(frozen=True)
class Quantized:
    """The quantiser's output for one tensor."""

    shift: float  # exactly representable in fp32
    levels: tuple[float, float, float, float]  # each exactly representable in fp32
    codes: torch.Tensor  # uint8 in [0, 3], one per kept value

    def table(self) -> torch.Tensor:
        """The four dequantised values, ``level[j] + shift`` in fp32."""
        return dequant_table(self.shift, self.levels)

    def stats_bytes(self) -> bytes:
        """``shift`` and the four levels as 20 bytes of little-endian fp32."""
        return _STATS.pack(self.shift, *self.levels)


def dequant_table(shift: float, levels: tuple[float, ...]) -> torch.Tensor:
    """``level[j] + shift`` for j in 0..3, one IEEE fp32 addition each."""
    with np.errstate(over="ignore"):  # an overflow to inf is reported by the callers
        table = np.array(levels, dtype=np.float32) + np.float32(shift)
    return torch.from_numpy(table)


def unpack_stats(data: bytes) -> tuple[float, tuple[float, float, float, float]]:
    """Parse the 20-byte statistics block into ``(shift, levels)`` (no validation)."""
    shift, *levels = _STATS.unpack(data)
    return shift, (levels[0], levels[1], levels[2], levels[3])


STATS_SIZE = _STATS.size


def _to_f32(x: float) -> float:
    """Round a float to the nearest fp32 value (inf past the fp32 range, never an error)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def quantize(values: torch.Tensor) -> Quantized:
    """Quantise a 1-D fp32 tensor of kept values to 2-bit codes (see module docstring)."""
    n = values.numel()
    if n == 0:
        return Quantized(0.0, (0.0, 0.0, 0.0, 0.0), torch.zeros(0, dtype=torch.uint8))
    v = values.numpy().astype(np.float64)
    shift = float(v.mean())
    c = v - shift
    sigma = float(c.std(ddof=1)) if n > 1 else math.nan
    scale = 6.0 * sigma / 4.0
    if not math.isfinite(scale) or scale == 0.0:
        scale = 1.0
    codes, counts, sums = _codes(c, scale)
    levels = tuple(_to_f32(float(sums[j]) / int(counts[j])) if counts[j] else 0.0 for j in range(4))
    return Quantized(_to_f32(shift), levels, torch.from_numpy(codes))  # type: ignore[arg-type]


@numba.njit(cache=True, nogil=True)
def _codes(c, scale):
    # Each value's code, and per code the count and the sum of c in value order: the numbers
    # np.clip(np.rint(c / scale + 2), 0, 3) and np.bincount gave, in one pass without the GIL.
    # np.rint rounds halves to even, as the specification requires.
    codes = np.empty(c.size, dtype=np.uint8)
    counts = np.zeros(4, dtype=np.int64)
    sums = np.zeros(4, dtype=np.float64)
    for i in range(c.size):
        j = int(min(max(np.rint(c[i] / scale + 2.0), 0.0), 3.0))
        codes[i] = j
        counts[j] += 1
        sums[j] += c[i]
    return codes, counts, sums


def pack_codes(codes: torch.Tensor) -> bytes:
    """Pack 2-bit codes four to a byte, the first code in the two most significant bits."""
    n = codes.numel()
    p = np.zeros((n + 3) // 4 * 4, dtype=np.uint8)
    p[:n] = codes.numpy()
    return ((p[0::4] << 6) | (p[1::4] << 4) | (p[2::4] << 2) | p[3::4]).tobytes()


def codes_canonical(data: bytes, count: int) -> bool:
    """Whether ``data`` is exactly the packing of ``count`` codes, with zero padding bits."""
    if len(data) != (count + 3) // 4:
        return False
    pad = len(data) * 4 - count  # unused 2-bit slots in the last byte
    return not data or not data[-1] & ((1 << (2 * pad)) - 1)


def unpack_codes(data: bytes, count: int) -> np.ndarray | None:
    """Inverse of ``pack_codes``; ``None`` when the length or padding is not canonical."""
    if not codes_canonical(data, count):
        return None
    if not data:
        return np.zeros(0, dtype=np.uint8)
    codes: np.ndarray = _unpack(np.frombuffer(data, dtype=np.uint8), count)
    return codes


@numba.njit(cache=True, nogil=True)
def count_codes(codes):
    """How many of the 2-bit ``codes`` (uint8) are 0, 1, 2 and 3 (int64, length 4)."""
    counts = np.zeros(4, dtype=np.int64)
    for c in codes:
        counts[c & 3] += 1
    return counts


@numba.njit(cache=True, nogil=True)
def _unpack(data, count):
    """Four 2-bit codes per byte of ``data``, the first in the top bits; the first ``count``."""
    out = np.empty(count, dtype=np.uint8)
    for j in range(count):
        out[j] = (data[j >> 2] >> (6 - 2 * (j & 3))) & 3
    return out
