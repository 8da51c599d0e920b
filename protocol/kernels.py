"""Compiled inner loops of the codec (numba): Top-k selection per tile and Rice decoding.

These two loops are where a vectorised numpy/torch codec spends most of its time (a full
``torch.topk`` plus tie detection and sorting on the encode side; dozens of array passes per
tensor on the decode side). Written as plain loops and compiled, each is a single pass over its
data. They compute exactly what the module docstrings of ``protocol.codec`` and
``protocol.indexcode`` specify; ``tests/`` checks them against a slow reference.

The selection kernel runs tiles in parallel. numba's default thread pool must not be entered
from two Python threads at once, so calls are serialised with a lock.
"""

from __future__ import annotations

import threading

import numba
import numpy as np

_PARALLEL_LOCK = threading.Lock()

# Status codes of ``decode_positions``; the caller turns them into PayloadError messages.
OK = 0
TOO_FEW_CODES = 1
GAP_OUT_OF_TILE = 2
TRAILING_BITS = 3
TRAILING_BYTES = 4
REMAINDER_PADDING = 5
QUOTIENT_TOO_LARGE = 6


@numba.njit(cache=True, nogil=True)
def _sift_down(heap: np.ndarray, i: int, n: int) -> None:
    # A min-heap of magnitudes: heap[0] is the smallest of the k largest seen so far.
    v = heap[i]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and heap[child + 1] < heap[child]:
            child += 1
        if heap[child] >= v:
            break
        heap[i] = heap[child]
        i = child
    heap[i] = v


@numba.njit(cache=True, nogil=True, parallel=True)
def _select(x, h, w, k, positions, flat, values, bad):
    rows, cols = x.shape
    gc = cols // w
    n_tiles = (rows // h) * gc
    tile_len = h * w
    for t in numba.prange(n_tiles):
        ti = t // gc
        tj = t - ti * gc
        heap = np.empty(k, dtype=np.float32)
        mags = np.empty(tile_len, dtype=np.float32)
        n = 0
        finite = True
        for r in range(h):
            row = ti * h + r
            for c in range(w):
                v = abs(x[row, tj * w + c])
                if not np.isfinite(v):
                    finite = False
                mags[r * w + c] = v
                if n < k:
                    # Fill phase: insert and sift up.
                    j = n
                    n += 1
                    while j > 0:
                        parent = (j - 1) // 2
                        if heap[parent] <= v:
                            break
                        heap[j] = heap[parent]
                        j = parent
                    heap[j] = v
                elif v > heap[0]:
                    heap[0] = v
                    _sift_down(heap, 0, k)
        if not finite:
            bad[t] = 1
            continue
        thr = heap[0]  # the k-th largest magnitude of the tile
        above = 0
        for p in range(tile_len):
            if mags[p] > thr:
                above += 1
        ties = k - above  # entries equal to thr that are kept: the lowest positions
        out = t * k
        for p in range(tile_len):
            m = mags[p]
            if m > thr or (m == thr and ties > 0):
                if m == thr:
                    ties -= 1
                r = p // w
                c = p - r * w
                positions[t, out - t * k] = p
                idx = (ti * h + r) * cols + tj * w + c
                flat[out] = idx
                values[out] = x[ti * h + r, tj * w + c]
                out += 1


def select_topk(
    x: np.ndarray, h: int, w: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Top-k by magnitude of every h x w tile of the fp32 matrix ``x``, ties to lower positions.

    Returns ``(positions (n_tiles, k) ascending, flat row-major indices, signed values,
    all_finite)``; when ``all_finite`` is False the other outputs are meaningless.
    """
    rows, cols = x.shape
    n_tiles = (rows // h) * (cols // w)
    positions = np.empty((n_tiles, k), dtype=np.int64)
    flat = np.empty(n_tiles * k, dtype=np.int64)
    values = np.empty(n_tiles * k, dtype=np.float32)
    bad = np.zeros(n_tiles, dtype=np.uint8)
    with _PARALLEL_LOCK:
        _select(x, h, w, k, positions, flat, values, bad)
    return positions, flat, values, not bad.any()


@numba.njit(cache=True, nogil=True)
def decode_positions(unary, rem, b, n_tiles, k, tile_len, h, w, cols, flat):
    """Decode Rice-coded gaps straight into flat indices; returns a status code.

    ``unary`` and ``rem`` are uint8 arrays; ``flat`` (int32 or int64, n_tiles * k) receives the
    row-major index of every kept entry, tile by tile. Rejects quotients or positions past the
    tile, missing codes, and any bit or byte after the last code.
    """
    n_bits = unary.size * 8
    bit = 0  # read position in the unary stream
    qmax = tile_len >> b
    gc = cols // w
    j = 0
    for t in range(n_tiles):
        ti = t // gc
        tj = t - ti * gc
        base = ti * h * cols + tj * w
        pos = -1
        for _ in range(k):
            q = 0
            while True:
                if bit >= n_bits:
                    return TOO_FEW_CODES
                one = (unary[bit >> 3] >> (7 - (bit & 7))) & 1
                bit += 1
                if one:
                    break
                q += 1
                if q > qmax:
                    return QUOTIENT_TOO_LARGE
            r = 0
            if b:
                start = j * b
                for i in range(b):
                    s = start + i
                    r = (r << 1) | ((rem[s >> 3] >> (7 - (s & 7))) & 1)
            pos += ((q << b) | r) + 1
            if pos >= tile_len:
                return GAP_OUT_OF_TILE
            row = pos // w
            flat[j] = base + row * cols + (pos - row * w)
            j += 1
    if (bit + 7) // 8 != unary.size:
        return TRAILING_BYTES
    for s in range(bit, n_bits):
        if (unary[s >> 3] >> (7 - (s & 7))) & 1:
            return TRAILING_BITS
    total = j * b
    for s in range(total, rem.size * 8):
        if (rem[s >> 3] >> (7 - (s & 7))) & 1:
            return REMAINDER_PADDING
    return OK
