"""Compiled Rice coding of in-tile positions (numba): encode, decode (to indices, to in-tile
positions, or only checking), and in-tile positions to indices.

They compute exactly what ``protocol.indexcode`` specifies (the stream layout, the choice of
``b``, the rules a decoder enforces); ``tests/`` checks them against a slow reference. Every
kernel is serial and ``nogil``: a payload's tensors are decoded side by side by
``protocol.kernels.map_threads``.
"""

from __future__ import annotations

import numba
import numpy as np

# Status codes of ``decode_positions``; the caller turns them into PayloadError messages.
OK = 0
TOO_FEW_CODES = 1
GAP_OUT_OF_TILE = 2
TRAILING_BITS = 3
TRAILING_BYTES = 4
REMAINDER_PADDING = 5
QUOTIENT_TOO_LARGE = 6

# Leading zero bits of every byte value (8 for zero).
_CLZ8 = np.array([8] + [7 - int(v).bit_length() + 1 for v in range(1, 256)], dtype=np.int64)


@numba.njit(cache=True, nogil=True)
def decode_positions(unary, rem, b, n_tiles, k, tile_len, h, w, cols, flat, local=False):
    """Decode Rice-coded gaps straight into flat indices; returns a status code.

    ``unary`` is a uint8 array; ``rem`` the remainder stream followed by 4 zero bytes (so a
    field can always be read from a 4-byte window). ``flat`` (int32 or int64, n_tiles * k)
    receives the row-major index of every kept entry, tile by tile. Rejects quotients or
    positions past the tile, missing codes, and any bit or byte after the last code.

    With ``local``, ``flat`` receives each entry's position inside its tile instead (uint16
    when the tile has at most 65,536 entries: half the bytes of an index, which is how a lazy
    payload keeps what it decoded while checking; ``expand_positions`` turns them into
    indices). An empty ``flat`` only checks: every rule above is applied, nothing is written.
    """
    n_bytes = unary.size
    rem_bytes = rem.size - 4
    bit = 0  # read position in the unary stream
    qmax = tile_len >> b
    gc = cols // w
    mask = (1 << b) - 1
    write = flat.size > 0
    j = 0
    for t in range(n_tiles):
        ti = t // gc
        tj = t - ti * gc
        base = ti * h * cols + tj * w
        pos = -1
        for _ in range(k):
            q = 0
            while True:
                byte = bit >> 3
                if byte >= n_bytes:
                    return TOO_FEW_CODES
                used = bit & 7
                cur = (unary[byte] << used) & 0xFF  # the unread bits of this byte, at the top
                if cur == 0:
                    q += 8 - used
                    bit = (byte + 1) << 3
                    if q > qmax:
                        return QUOTIENT_TOO_LARGE
                    continue
                lz = _CLZ8[cur]
                q += lz
                bit += lz + 1
                break
            if q > qmax:
                return QUOTIENT_TOO_LARGE
            r = 0
            if b:
                s = j * b
                i = s >> 3
                window = (
                    (np.int64(rem[i]) << 24)
                    | (np.int64(rem[i + 1]) << 16)
                    | (np.int64(rem[i + 2]) << 8)
                    | rem[i + 3]
                )
                r = (window >> (32 - (s & 7) - b)) & mask
            pos += ((q << b) | r) + 1
            if pos >= tile_len:
                return GAP_OUT_OF_TILE
            if write:
                if local:
                    flat[j] = pos
                else:
                    row = pos // w
                    flat[j] = base + row * cols + (pos - row * w)
            j += 1
    if (bit + 7) // 8 != n_bytes:
        return TRAILING_BYTES
    for s in range(bit, n_bytes * 8):
        if (unary[s >> 3] >> (7 - (s & 7))) & 1:
            return TRAILING_BITS
    for s in range(j * b, rem_bytes * 8):
        if (rem[s >> 3] >> (7 - (s & 7))) & 1:
            return REMAINDER_PADDING
    return OK


@numba.njit(cache=True, nogil=True)
def rice_encode(positions, max_bits):
    """Rice-code ascending tile positions ``(n_tiles, k)``; returns ``(b, unary, remainders)``.

    ``b`` minimises ``sum(g >> b) + n * (b + 1)`` over a window around log2 of the mean gap
    (the smallest such ``b`` on ties); the streams are uint8 arrays as ``protocol.indexcode``
    describes.
    """
    n_tiles, k = positions.shape
    n = n_tiles * k
    gaps = np.empty(n, dtype=np.int64)
    total = 0
    for t in range(n_tiles):
        prev = -1
        for i in range(k):
            g = positions[t, i] - prev - 1
            prev = positions[t, i]
            gaps[t * k + i] = g
            total += g
    if n == 0:
        return 0, np.zeros(0, dtype=np.uint8), np.zeros(0, dtype=np.uint8)
    mean = total // n  # int(mean) of the exact mean, as the bit length only needs its floor
    guess = 0
    while (mean >> (guess + 1)) > 0:
        guess += 1
    best_b = -1
    best_cost = 0
    for b in range(max(0, guess - 2), min(max_bits, guess + 3) + 1):
        cost = n * (b + 1)
        for j in range(n):
            cost += gaps[j] >> b
        if best_b < 0 or cost < best_cost:
            best_b = b
            best_cost = cost
    b = best_b
    n_unary_bits = best_cost - n * b  # sum(q) + n
    unary = np.zeros((n_unary_bits + 7) // 8, dtype=np.uint8)
    rem = np.zeros((n * b + 7) // 8, dtype=np.uint8)
    bit = 0
    mask = (1 << b) - 1
    # Remainders go through an accumulator, whole bytes out as they fill: setting them bit by
    # bit branched on every (random) bit, and the mispredictions were most of the encoder.
    acc = 0  # the pending bits, fewer than 8 between gaps (at most 7 + b <= 27 inside one)
    pending = 0
    out = 0
    for j in range(n):
        g = gaps[j]
        bit += g >> b
        unary[bit >> 3] |= np.uint8(0x80 >> (bit & 7))
        bit += 1
        acc = (acc << b) | (g & mask)
        pending += b
        while pending >= 8:
            pending -= 8
            rem[out] = (acc >> pending) & 0xFF
            out += 1
        acc &= (1 << pending) - 1
    if pending:
        rem[out] = (acc << (8 - pending)) & 0xFF
    return b, unary, rem


@numba.njit(cache=True, nogil=True)
def expand_positions(positions, k, h, w, cols, flat):
    """Row-major flat indices (``flat``) of in-tile ``positions`` (each tile's ``k`` entries
    in turn, as ``decode_positions(..., local=True)`` writes them), tile by tile."""
    # The offset of every in-tile position from the tile's corner, looked up: a table of one
    # tile (16 KB at 64 x 64) stays in cache, and a division or a row counter per entry was
    # as slow as decoding the stream again.
    offset = np.empty(h * w, dtype=flat.dtype)
    for r in range(h):
        for c in range(w):
            offset[r * w + c] = r * cols + c
    gc = cols // w
    n_tiles = positions.size // k if k else 0
    for t in range(n_tiles):
        ti = t // gc
        base = ti * h * cols + (t - ti * gc) * w
        for j in range(t * k, t * k + k):
            flat[j] = base + offset[positions[j]]
