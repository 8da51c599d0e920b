"""Compiled inner loops of the codec (numba): Top-k per tile and the dense reconstruction, the
discipline around numba's thread pool, and ``map_threads`` to run serial (``nogil``) loops such as
the Rice kernels (``protocol.rice_kernels``) side by side.

They compute exactly what the module docstring of ``protocol.codec`` specifies; ``tests/``
checks them against a slow reference. The selection and reconstruction run
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
