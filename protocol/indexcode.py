"""Index coding: the kept positions of every tile as Rice-coded gaps in two bit streams.

Within a tile the ``k`` kept positions ``p_0 < p_1 < ... < p_{k-1}`` become gaps
``g_0 = p_0`` and ``g_j = p_j - p_{j-1} - 1`` (all ``>= 0``; repeated or decreasing positions
cannot be expressed at all). Each gap is split by the Rice parameter ``b`` into a quotient
``q = g >> b`` and a remainder ``r = g & (2**b - 1)``. Unlike textbook Rice coding, which
interleaves the two, the quotients of the whole tensor go into a *unary stream* (``q`` zero bits,
then a one) and the remainders into a *remainder stream* of fixed ``b``-bit fields. The total size
is the same. Encoder and decoder are compiled loops in ``protocol.rice_kernels`` that make one pass
each; the decoder validates as it goes.

Bits are written most significant first within each byte; the final byte is padded with zeros.
With ``b`` chosen per tensor to minimise the total, random ``k``-subsets cost about 2-3 % over the
entropy bound ``log2 C(tile_len, k)`` (7.58 bits against 7.36 per index at k=64 of 4096).

Everything here is pure computation on arrays and bytes; validation errors raise
``PayloadError``.
"""

from __future__ import annotations

import numpy as np
import torch

from protocol import rice_kernels
from protocol.errors import PayloadError
from protocol.tiles import TileGeometry

#: Largest Rice parameter the format allows (gaps are < MAX_TILE**2 = 2**20).
MAX_RICE_BITS = 20


def encode_positions(positions: torch.Tensor) -> tuple[int, bytes, bytes]:
    """Rice-code sorted tile positions; returns ``(b, unary_stream, remainder_stream)``."""
    pos = np.ascontiguousarray(positions.numpy(), dtype=np.int64)
    b, unary, rem = rice_kernels.rice_encode(pos, MAX_RICE_BITS)
    return int(b), unary.tobytes(), rem.tobytes()


def max_unary_bytes(n_tiles: int, k: int, tile_len: int, b: int) -> int:
    """Upper bound on a valid unary stream's length: guards allocation before unpacking.

    Each tile's gaps sum to at most ``tile_len - k``, so its quotients sum to at most
    ``(tile_len - k) >> b`` (plus rounding); each index adds one terminating bit.
    """
    per_tile = k + ((tile_len - k) >> b) + 1
    return (n_tiles * per_tile + 7) // 8


_STATUS = {
    rice_kernels.TOO_FEW_CODES: ("unary", "fewer codes than the tiles keep"),
    rice_kernels.GAP_OUT_OF_TILE: ("indices", "a position lies outside its tile"),
    rice_kernels.TRAILING_BITS: ("unary", "one bits after the last code"),
    rice_kernels.TRAILING_BYTES: ("unary", "trailing bytes after the last code"),
    rice_kernels.REMAINDER_PADDING: ("remainders", "non-zero padding bits"),
    rice_kernels.QUOTIENT_TOO_LARGE: ("unary", "a run of zeros longer than any gap inside a tile"),
}


def decode_flat_index(
    b: int, unary: bytes, rem: bytes, *, geometry: TileGeometry, field: str
) -> torch.Tensor:
    """Inverse of ``encode_positions``, straight to row-major indices into the flat tensor.

    Returns ``n_kept`` indices (int32, or int64 for tensors of 2**31 elements or more) in
    payload order: tile by tile, ascending inside each tile. Raises ``PayloadError`` (naming
    ``field``) unless the streams hold exactly the right number of codes, are canonically
    padded, and every position lies inside its tile.
    """
    return _walk(b, unary, rem, geometry=geometry, field=field, write=True)


def check_index(b: int, unary: bytes, rem: bytes, *, geometry: TileGeometry, field: str) -> None:
    """Every check of ``decode_flat_index``, without materialising the indices."""
    _walk(b, unary, rem, geometry=geometry, field=field, write=False)


#: Largest tile whose in-tile positions ``decode_tile_positions`` keeps (as uint16).
MAX_LOCAL_TILE_LEN = 1 << 16


def decode_tile_positions(
    b: int, unary: bytes, rem: bytes, *, geometry: TileGeometry, field: str
) -> np.ndarray:
    """Every check of ``decode_flat_index``; returns each kept entry's position inside its
    tile (uint16, tiles of at most ``MAX_LOCAL_TILE_LEN`` entries), in payload order.

    Two bytes an entry, half an index: a lazy payload keeps these from its check, so each
    stream is decoded once; ``flat_index_of`` gives the indices when the tensor is used.
    """
    if geometry.tile_len > MAX_LOCAL_TILE_LEN:
        raise ValueError(f"tiles of {geometry.tile_len} entries do not fit uint16 positions")
    out = _walk(b, unary, rem, geometry=geometry, field=field, write=True, local=True)
    return out.numpy()


def flat_index_of(positions: np.ndarray, geometry: TileGeometry) -> torch.Tensor:
    """The row-major indices (as ``decode_flat_index`` gives them) of ``positions`` from
    ``decode_tile_positions``: a division-free pass, no bit decoding."""
    g = geometry
    flat = np.empty(positions.size, dtype=np.int32 if g.numel < 2**31 else np.int64)
    if flat.size:
        rice_kernels.expand_positions(positions, g.k, g.h, g.w, g.cols, flat)
    return torch.from_numpy(flat)


def _walk(
    b: int,
    unary: bytes,
    rem: bytes,
    *,
    geometry: TileGeometry,
    field: str,
    write: bool,
    local: bool = False,
) -> torch.Tensor:
    if not 0 <= b <= MAX_RICE_BITS:
        raise PayloadError(f"{field}.rice_bits", f"must be in [0, {MAX_RICE_BITS}], got {b}")
    g = geometry
    n = g.n_kept
    limit = max_unary_bytes(g.n_tiles, g.k, g.tile_len, b)
    if len(unary) > limit:
        raise PayloadError(f"{field}.unary", f"{len(unary)} bytes exceeds the limit {limit}")
    expected = (n * b + 7) // 8
    if len(rem) != expected:
        raise PayloadError(
            f"{field}.remainders",
            f"expected {expected} bytes for {n} fields of {b} bits, got {len(rem)}",
        )
    dtype = np.uint16 if local else np.int32 if g.numel < 2**31 else np.int64
    flat = np.empty(n if write else 0, dtype=dtype)
    if n == 0:
        if unary:
            raise PayloadError(f"{field}.unary", "must be empty when nothing is kept")
        return torch.from_numpy(flat)
    status = rice_kernels.decode_positions(
        np.frombuffer(unary, dtype=np.uint8),
        np.frombuffer(rem + bytes(4), dtype=np.uint8),
        b,
        g.n_tiles,
        g.k,
        g.tile_len,
        g.h,
        g.w,
        g.cols,
        flat,
        local,
    )
    if status != rice_kernels.OK:
        part, message = _STATUS[status]
        raise PayloadError(f"{field}.{part}", message)
    return torch.from_numpy(flat)
