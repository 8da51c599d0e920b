"""Compiled inner loops of the codec (numba): Top-k per tile and the dense reconstruction, the
discipline around numba's thread pool, and ``map_threads`` to run serial (``nogil``) loops such as
the Rice kernels (``protocol.rice_kernels``) side by side.

They compute exactly what the module docstring of ``protocol.codec`` specifies; ``tests/``
checks them against a slow reference. Every kernel here is serial and ``nogil``: the selection
runs pieces of all of a model's tiles on ``map_threads``' threads, and the encoder fills its
tensors' reconstructions side by side the same way. One parallel region per tensor (numba's
``prange``) left the serial steps between them (quantiser, index coding, zstd) on one core,
and encode gained 1.5x from a second core where a memory copy gains 2x (docs/benchmarks.md,
section 9). Other compiled loops that do use numba's thread pool (the aggregation's) must not
enter it from two Python threads at once, so those calls go through ``parallel()``, which
serialises them with ``PARALLEL_LOCK``.

``parallel()`` and ``map_threads`` keep the caller's torch thread count. numba's OpenMP threading
layer and torch share one OpenMP runtime (torch's wheel ships ``libgomp.so.1``, the very name
numba's layer loads), and numba, when it starts its pool (its first parallel call or
``numba.get_num_threads()`` in the process), sets the calling thread's OpenMP thread count to its
own (``NUMBA_NUM_THREADS``: every core unless set). torch sizes its parallel regions by that count.
A node's first encode, at the end of round 0 on its compute thread, so put every later round's
inner steps on every core whatever ``--threads`` said: two nodes started with ``--threads 1`` on 2
cores trained at about 800 tokens/s in round 0 and 140-200 after it, at 4-5x the CPU time per inner
step (README, benchmark 16; ``tests/test_training_speed.py``).
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


@numba.njit(cache=True, nogil=True)
def _select(x, h, w, k, t0, t1, positions, flat, values, bad):
    # Tiles t0..t1 - 1 of x; ``flat`` is written only where it is not empty.
    cols = x.shape[1]
    gc = cols // w
    tile_len = h * w
    stride = 8  # sample every 8th magnitude to guess a threshold
    n_sample = tile_len // stride
    m = k // stride + k // (2 * stride) + 2  # sample rank of the guess, with a safety margin
    sampled = m <= n_sample // 2
    with_flat = flat.size > 0
    mags = np.empty(tile_len, dtype=np.float32)
    mbits = mags.view(np.int32)
    cand = np.empty(tile_len, dtype=np.int64)
    cbits = np.empty(tile_len, dtype=np.int32)
    sample = np.empty(max(1, n_sample), dtype=np.int32)
    one = np.empty(1, dtype=np.int32)
    one_f = one.view(np.float32)
    # The threshold found in one tile, lowered by ``factor``, is the first guess for the next
    # (neighbouring tiles share rows, so their scales are alike). A guess only saves work:
    # whenever fewer than k entries reach it, the tile is searched without it.
    guess = np.float32(-1.0)
    factor = np.float32(0.8)
    for t in range(t0, t1):
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
            # Guess a threshold from a sample; if at least k entries reach it, the guess is at
            # or below the true k-th largest, and the exact answer lies among them.
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
            if with_flat:
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


#: Entries per piece of the selection's work (``select_topk_many``): about a millisecond on one
#: core, so that the last pieces even out the threads' ends, and enough per piece that handing
#: one out (a few microseconds of Python) is noise.
PIECE_ENTRIES = 1 << 20

#: One selection's inputs: the fp32 matrix, the tile's height and width, the entries kept.
Selection = tuple[np.ndarray, int, int, int]


def select_topk(
    x: np.ndarray, h: int, w: int, k: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Top-k by magnitude of every h x w tile of the fp32 matrix ``x``, ties to lower positions.

    Returns ``(positions (n_tiles, k) ascending, flat row-major indices, signed values,
    all_finite)``; when ``all_finite`` is False the other outputs are meaningless.
    """
    return select_topk_many([(x, h, w, k)], flat=True)[0]


def select_topk_many(
    jobs: Sequence[Selection], *, flat: bool = False
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, bool]]:
    """``select_topk`` of every ``(x, h, w, k)`` of ``jobs``, the flat indices only with
    ``flat`` (else empty arrays), on ``map_threads``' threads.

    The tiles of all the matrices are cut into pieces of about ``PIECE_ENTRIES`` entries,
    handed out largest first, so a model's tensors of every size keep every thread busy up to
    the end, with no parallel region opened per tensor.
    """
    outs = []
    pieces: list[tuple[int, int, int]] = []
    for j, (x, h, w, k) in enumerate(jobs):
        n_tiles = (x.shape[0] // h) * (x.shape[1] // w)
        outs.append(
            (
                np.empty((n_tiles, k), dtype=np.int64),
                np.empty(n_tiles * k if flat else 0, dtype=np.int64),
                np.empty(n_tiles * k, dtype=np.float32),
                np.zeros(n_tiles, dtype=np.uint8),
            )
        )
        step = max(1, PIECE_ENTRIES // (h * w))
        pieces += [(j, t0, min(n_tiles, t0 + step)) for t0 in range(0, n_tiles, step)]

    def run(piece: tuple[int, int, int]) -> None:
        j, t0, t1 = piece
        x, h, w, k = jobs[j]
        _select(x, h, w, k, t0, t1, *outs[j])

    map_threads(run, pieces, cost=[(t1 - t0) * jobs[j][1] * jobs[j][2] for j, t0, t1 in pieces])
    return [(pos, idx, vals, not bad.any()) for pos, idx, vals, bad in outs]


@numba.njit(cache=True, nogil=True)
def _fill(out, positions, codes, table, h, w):
    # Band by band (a band is one row of tiles: h whole rows, contiguous in ``out``): zero the
    # band in one sequential run, then write its kept entries while it is still in cache.
    rows, cols = out.shape
    flat = out.reshape(-1)
    k = positions.shape[1]
    gc = cols // w
    size = h * cols
    # Offsets of every in-tile position from the tile's corner, looked up rather than divided.
    offset = np.empty(h * w, dtype=np.int64)
    for r in range(h):
        for c in range(w):
            offset[r * w + c] = r * cols + c
    for band in range(rows // h):
        # A slice, zeroed whole: an element loop over the 1-D view was 6x slower (numba kept
        # the negative-index checks, which block vector code).
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
    each h x w tile (``positions`` as ``select_topk`` returns them), 0 elsewhere.

    Serial and ``nogil``: the encoder fills several tensors side by side (``map_threads``)."""
    _fill(out, positions, codes, table, h, w)


def map_threads(
    fn: Callable[[_T], _R], items: Sequence[_T], *, cost: Sequence[float] | None = None
) -> list[_R]:
    """``[fn(i) for i in items]`` on numba's thread count of threads (the caller's among
    them), for serial ``nogil`` kernels that then run side by side.

    Each thread takes the next item when it is done with one, in descending ``cost`` where
    given (the large ones first, so the small ones even out the ends), else in order. Results
    come back in item order; if calls fail, the error of the first failing item in item order
    is raised, as the plain loop would. ``fn`` must not call ``map_threads`` itself.
    """
    workers = min(len(items), pool_threads())
    if workers <= 1:
        return [fn(i) for i in items]
    with _POOL_LOCK:
        if not _POOL:
            size: int = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
            _POOL.append(ThreadPoolExecutor(size, "codec"))
    order = (
        range(len(items))
        if cost is None
        else sorted(range(len(items)), key=cost.__getitem__, reverse=True)
    )
    queue = iter(order)
    queue_lock = threading.Lock()
    done: list[tuple[bool, object]] = [(False, None)] * len(items)

    def work() -> None:
        while True:
            with queue_lock:
                i = next(queue, None)
            if i is None:
                return
            try:
                done[i] = (True, fn(items[i]))
            except Exception as exc:  # re-raised below, in item order
                done[i] = (False, exc)

    futures = [_POOL[0].submit(work) for _ in range(workers - 1)]
    work()
    for f in futures:
        f.result()
    out: list[_R] = []
    for ok, value in done:
        if not ok:
            raise value  # type: ignore[misc]
        out.append(value)  # type: ignore[arg-type]
    return out
