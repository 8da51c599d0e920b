"""Compiled inner loops of the codec (numba): Top-k per tile, the dense reconstruction, Rice
coding, and ``map_threads`` to run the serial (``nogil``) loops side by side.

They compute exactly what the module docstrings of ``protocol.codec`` and ``protocol.indexcode``
specify; ``tests/`` checks them against a slow reference. The selection and reconstruction run
tiles in parallel; numba's thread pool must not be entered from two Python threads at once, so
those calls go through ``parallel()``, which serialises them with ``PARALLEL_LOCK``.

Both keep the caller's torch thread count. numba's OpenMP threading layer and torch share one
OpenMP runtime (torch's wheel ships ``libgomp.so.1``, the very name numba's layer loads), and
numba, when it starts its pool (its first parallel call or ``numba.get_num_threads()`` in the
process), sets the calling thread's OpenMP thread count to its own (``NUMBA_NUM_THREADS``:
every core unless set). torch sizes its parallel regions by that count. A node's first encode,
at the end of round 0 on its compute thread, so put every later round's inner steps on every
core whatever ``--threads`` said: two nodes started with ``--threads 1`` on 2 cores trained at
about 800 tokens/s in round 0 and 140-200 after it, at 4-5x the CPU time per inner step (README,
benchmark 16; ``tests/test_training_speed.py``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numba
import numpy as np
import torch

_T = TypeVar("_T")
_R = TypeVar("_R")
_POOL: list[ThreadPoolExecutor] = []  # created on first use, never at import
_POOL_LOCK = threading.Lock()

#: Held around every call into numba's parallel thread pool (``parallel``).
PARALLEL_LOCK = threading.Lock()


@contextlib.contextmanager
def _torch_threads_kept() -> Iterator[None]:
    """The calling thread's torch (OpenMP) thread count as it was before (see the module doc)."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@contextlib.contextmanager
def parallel() -> Iterator[None]:
    """Around a call into numba's parallel pool: one caller at a time, torch's threads kept."""
    with PARALLEL_LOCK, _torch_threads_kept():
        yield


def pool_threads() -> int:
    """numba's thread count for the calling thread (its pool started if need be, torch's
    threads kept)."""
    with _torch_threads_kept():
        return numba.get_num_threads()


# Status codes of ``decode_positions``; the caller turns them into PayloadError messages.
OK = 0
TOO_FEW_CODES = 1
GAP_OUT_OF_TILE = 2
TRAILING_BITS = 3
TRAILING_BYTES = 4
REMAINDER_PADDING = 5
QUOTIENT_TOO_LARGE = 6


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "nsz"})
def _gather_abs(x, row0, col0, h, w, mags):
    # |x| of one tile into ``mags`` (row-major in the tile); False if any value is NaN or inf.
    # x * 0 is NaN exactly for NaN and +-inf; "reassoc" lets the probe sum vectorise without
    # assuming anything about NaN or inf. Rows are taken as 1-D slices so the inner loop
    # compiles to vector code (indexing the 2-D array element by element did not: 25x slower).
    probe = np.float32(0.0)
    for r in range(h):
        row = x[row0 + r, col0 : col0 + w]
        out = mags[r * w : r * w + w]
        for c in range(w):
            v = row[c]
            probe += v * np.float32(0.0)
            out[c] = abs(v)
    return probe == probe


@numba.njit(cache=True, nogil=True)
def _kth_largest_bits(bits, n, k):
    # The k-th largest of bits[:n] (k <= n): non-negative int32, the bit patterns of finite
    # fp32 magnitudes, which order as the floats do. Found one bit at a time from the top,
    # each a counting pass that compiles to vector code: about 20x faster than a heap of k at
    # the candidate counts _select sees (a heap's sift-downs branch unpredictably). Bits above
    # the highest one where the largest and smallest differ are shared by every value.
    hi = bits[0]
    lo = bits[0]
    for i in range(n):
        v = bits[i]
        hi = max(hi, v)
        lo = min(lo, v)
    diff = hi ^ lo
    top = 0
    while diff >> top:
        top += 1
    ans = hi & ~((1 << top) - 1)
    for b in range(top - 1, -1, -1):
        trial = ans | (1 << b)
        c = 0
        for i in range(n):
            c += bits[i] >= trial
        if c >= k:
            ans = trial
    return ans


@numba.njit(cache=True, nogil=True)
def _keep(mags, cand, n, k, thr, out):
    # From candidate positions cand[:n] (ascending; every entry reaching thr among them), write
    # to out the k kept ones: all above thr, then the lowest-positioned equal to thr.
    above = 0
    for i in range(n):
        if mags[cand[i]] > thr:
            above += 1
    ties = k - above
    m = 0
    for i in range(n):
        p = cand[i]
        v = mags[p]
        if v > thr or (v == thr and ties > 0):
            if v == thr:
                ties -= 1
            out[m] = p
            m += 1


@numba.njit(cache=True, nogil=True, parallel=True)
def _select(x, h, w, k, positions, flat, values, bad, chunks):
    rows, cols = x.shape
    gc = cols // w
    n_tiles = (rows // h) * gc
    tile_len = h * w
    stride = 8  # sample every 8th magnitude to guess a threshold
    n_sample = tile_len // stride
    m = k // stride + k // (2 * stride) + 2  # sample rank of the guess, with a safety margin
    sampled = m <= n_sample // 2
    # Tiles are shared out in contiguous runs, one run per chunk, each with its own buffers.
    for ch in numba.prange(chunks):
        mags = np.empty(tile_len, dtype=np.float32)
        mbits = mags.view(np.int32)
        cand = np.empty(tile_len, dtype=np.int64)
        cbits = np.empty(tile_len, dtype=np.int32)
        sample = np.empty(max(1, n_sample), dtype=np.int32)
        one = np.empty(1, dtype=np.int32)
        one_f = one.view(np.float32)
        # The threshold found in one tile, lowered by ``factor``, is the first guess for the
        # next (neighbouring tiles share rows, so their scales are alike). A guess only saves
        # work: whenever fewer than k entries reach it, the tile is searched without it.
        guess = np.float32(-1.0)
        factor = np.float32(0.8)
        for t in range(ch * n_tiles // chunks, (ch + 1) * n_tiles // chunks):
            ti = t // gc
            tj = t - ti * gc
            if not _gather_abs(x, ti * h, tj * w, h, w, mags):
                bad[t] = 1
                continue
            n = 0
            if guess >= 0:
                n = _at_least(mags, tile_len, guess, cand)
                if n < k:
                    factor *= np.float32(0.8)
                    n = 0
                elif n > 6 * k and factor < 0.95:
                    factor *= np.float32(1.05)
            if n == 0 and sampled:
                # Guess a threshold from a sample; if at least k entries reach it, the guess is
                # at or below the true k-th largest, and the exact answer lies among them.
                for i in range(n_sample):
                    sample[i] = mbits[i * stride]
                one[0] = _kth_largest_bits(sample, n_sample, m)
                n = _at_least(mags, tile_len, one_f[0], cand)
            if n < k:  # no usable guess: every position is a candidate
                for p in range(tile_len):
                    cand[p] = p
                n = tile_len
            for i in range(n):
                cbits[i] = mbits[cand[i]]
            one[0] = _kth_largest_bits(cbits, n, k)
            thr = one_f[0]
            guess = thr * factor
            _keep(mags, cand, n, k, thr, positions[t])
            for i in range(k):
                p = positions[t, i]
                r = p // w
                c = p - r * w
                flat[t * k + i] = (ti * h + r) * cols + tj * w + c
                values[t * k + i] = x[ti * h + r, tj * w + c]


@numba.njit(cache=True, nogil=True)
def _at_least(mags, n, guess, cand):
    # Positions of the entries reaching ``guess``, ascending, into ``cand``; returns how many.
    # Every position is written and the count advanced only on a hit: no branch to mispredict.
    m = 0
    for p in range(n):
        cand[m] = p
        m += mags[p] >= guess
    return m


def _chunks(n: int) -> int:
    """How many runs to split ``n`` tiles or entries into for the parallel loops."""
    return max(1, min(n, 4 * numba.get_num_threads()))


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
    with parallel():
        _select(x, h, w, k, positions, flat, values, bad, _chunks(n_tiles))
    return positions, flat, values, not bad.any()


@numba.njit(cache=True, nogil=True, parallel=True)
def _fill(out, positions, codes, table, h, w, chunks):
    # Band by band (a band is one row of tiles: h whole rows, contiguous in ``out``): zero the
    # band in one sequential run, then write its kept entries while it is still in cache.
    rows, cols = out.shape
    flat = out.reshape(-1)
    k = positions.shape[1]
    gc = cols // w
    n_bands = rows // h
    size = h * cols
    # Offsets of every in-tile position from the tile's corner, looked up rather than divided.
    offset = np.empty(h * w, dtype=np.int64)
    for r in range(h):
        for c in range(w):
            offset[r * w + c] = r * cols + c
    for ch in numba.prange(chunks):
        for band in range(ch * n_bands // chunks, (ch + 1) * n_bands // chunks):
            # A slice, zeroed whole: an element loop over the 1-D view was 6x slower
            # (numba kept the negative-index checks, which block vector code).
            out_band = flat[band * size : band * size + size]
            out_band[:] = 0.0
            for t in range(band * gc, (band + 1) * gc):
                col0 = (t - band * gc) * w
                for i in range(k):
                    out_band[col0 + offset[positions[t, i]]] = table[codes[t * k + i]]


def fill_dense(
    out: np.ndarray, positions: np.ndarray, codes: np.ndarray, table: np.ndarray, h: int, w: int
) -> None:
    """Write the dense matrix ``out`` (every entry): ``table[code]`` at each kept position of
    each h x w tile (``positions`` as ``select_topk`` returns them), 0 elsewhere."""
    with parallel():
        _fill(out, positions, codes, table, h, w, _chunks(out.shape[0] // h))


def _each(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[tuple[bool, object]]:
    out: list[tuple[bool, object]] = []
    for item in items:
        try:
            out.append((True, fn(item)))
        except Exception as exc:  # re-raised by map_threads, in item order
            out.append((False, exc))
    return out


def map_threads(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """``[fn(i) for i in items]`` with the items shared out over numba's thread count of
    Python threads, for serial ``nogil`` kernels that then run side by side. If calls fail,
    the error of the first failing item (in item order) is raised, as the plain loop would."""
    workers = min(len(items), pool_threads())
    if workers <= 1:
        return [fn(i) for i in items]
    with _POOL_LOCK:
        if not _POOL:
            size: int = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
            _POOL.append(ThreadPoolExecutor(size, "codec"))
    futures = [_POOL[0].submit(_each, fn, items[j::workers]) for j in range(workers)]
    groups = [f.result() for f in futures]
    out: list[_R] = []
    for i in range(len(items)):
        ok, value = groups[i % workers][i // workers]
        if not ok:
            raise value  # type: ignore[misc]
        out.append(value)  # type: ignore[arg-type]
    return out


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
    for j in range(n):
        g = gaps[j]
        bit += g >> b
        unary[bit >> 3] |= np.uint8(0x80 >> (bit & 7))
        bit += 1
        r = g & mask
        s = j * b
        for i in range(b):
            if (r >> (b - 1 - i)) & 1:
                rem[(s + i) >> 3] |= np.uint8(0x80 >> ((s + i) & 7))
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
