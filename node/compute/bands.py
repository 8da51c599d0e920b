"""The aggregation's compiled kernels: a tensor's peers summed one band of tiles at a time.

A band is one row of tiles (``h`` whole rows of the tensor). Every peer lists its kept entries
tile by tile, so a band's entries are one contiguous slice of each peer's index: ``kept[p]``
entries per band for peer p (its own k per tile: a node on a thin link keeps fewer,
``node.compute.linkbudget``), all inside ``band_size`` consecutive elements of the flattened
tensor. So the scratch of an aggregation is one band's sums and counts (per thread), never a
dense copy of the tensor, and bands are independent: they run in parallel without changing a
single sum. Peers are added in canonical order, one fp32 addition per entry each, and each
counts ``weights[p]`` times in an entry's denominator (1, or its work: ``node.compute.work``),
so every node forms the same sums (``node.compute.outer`` builds the peers' value tables and
calls these).
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
from numba.typed import List

from node.compute.work import PeerWeight
from protocol.codec import SparseTensor
from protocol.tiles import TileGeometry


def bands(geometry: TileGeometry) -> tuple[int, int, int]:
    """``(n_bands, kept_per_band, band_size)``: a band is one row of tiles, ``h`` whole rows.

    Every peer lists its kept entries tile by tile, so a band's entries are one contiguous
    slice of each peer's index, and they all fall in ``band_size`` consecutive elements of the
    flattened tensor. Aggregating band by band needs scratch for one band only.
    """
    gr, gc = geometry.grid
    return gr, gc * geometry.k, geometry.h * geometry.cols


@numba.njit(cache=True, nogil=True)
def sum_band(b, indices, codes, tables, kept, weights, size, sums, counts, touched):
    # Band b of every peer into the band-local sums and counts, peers one after another in
    # canonical order (each entry once per peer), so every sum is formed in the same order on
    # every node. Peer p keeps ``kept[p]`` entries per band (its own k per tile) and counts
    # ``weights[p]`` times in an entry's denominator (1, or its work: ``node.compute.work``).
    # Entries seen for the first time go to ``touched``; returns how many.
    base = b * size
    n = 0
    for p in range(len(indices)):
        index = indices[p]
        code = codes[p]
        lo = b * kept[p]
        w = weights[p]
        for j in range(lo, lo + kept[p]):
            i = index[j] - base
            if counts[i] == 0:
                touched[n] = i
                n += 1
            sums[i] += tables[p, code[j]]
            counts[i] += w
    return n


@numba.njit(cache=True, nogil=True, parallel=True)
def subtract_mean(
    theta, indices, codes, tables, kept, weights, n_bands, size, alpha, scaled, chunks
):
    # theta -= mean (times alpha when ``scaled``: a separate fp32 multiplication), band by
    # band. Bands are independent, so they run in parallel, each thread with its own band of
    # scratch, cleared again entry by entry after use.
    for c in numba.prange(chunks):
        sums = np.zeros(size, dtype=np.float32)
        counts = np.zeros(size, dtype=np.int32)
        touched = np.empty(size, dtype=np.int64)
        for b in range(c * n_bands // chunks, (c + 1) * n_bands // chunks):
            n = sum_band(b, indices, codes, tables, kept, weights, size, sums, counts, touched)
            base = b * size
            for j in range(n):
                i = touched[j]
                m = sums[i] / np.float32(counts[i])
                if scaled:
                    m = m * alpha
                theta[base + i] -= m
                sums[i] = 0.0
                counts[i] = 0


@numba.njit(cache=True, nogil=True)
def band_means(indices, codes, tables, kept, weights, n_bands, size, out_index, out_mean):
    # Every touched entry and its fp32 mean, band by band; returns how many.
    sums = np.zeros(size, dtype=np.float32)
    counts = np.zeros(size, dtype=np.int32)
    touched = np.empty(size, dtype=np.int64)
    m = 0
    for b in range(n_bands):
        n = sum_band(b, indices, codes, tables, kept, weights, size, sums, counts, touched)
        for j in range(n):
            i = touched[j]
            out_index[m] = b * size + i
            out_mean[m] = sums[i] / np.float32(counts[i])
            sums[i] = 0.0
            counts[i] = 0
            m += 1
    return m


def kept_and_weights(
    parts: Sequence[SparseTensor], weights: Sequence[PeerWeight] | None
) -> tuple[np.ndarray, np.ndarray]:
    """Per peer: the entries it keeps per band of tiles, and its count in a denominator."""
    gc = parts[0].geometry.grid[1]
    kept = np.array([gc * p.geometry.k for p in parts], dtype=np.int64)
    counts = [1] * len(parts) if weights is None else [w.post for w in weights]
    return kept, np.array(counts, dtype=np.int32)


def typed(arrays: Sequence[np.ndarray]) -> List:
    out = List()
    for a in arrays:
        out.append(a)
    return out


def peer_arrays(parts: Sequence[SparseTensor]) -> tuple[List, List]:
    """The peers' index and code arrays as numba lists (one index dtype for all)."""
    indices = [p.index.numpy() for p in parts]
    if len({a.dtype for a in indices}) > 1:
        indices = [a.astype(np.int64) for a in indices]
    return typed(indices), typed([p.codes.numpy() for p in parts])


def limit_threads(threads: int) -> None:
    """Use at most ``threads`` threads for torch and for this module's parallel loops (numba's
    pool sizes itself from ``NUMBA_NUM_THREADS`` at import, which ``sparseloco up`` sets but a
    node started by hand does not: ``--threads`` alone must bound both)."""
    import torch

    torch.set_num_threads(threads)
    pool: int = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
    numba.set_num_threads(max(1, min(threads, pool)))
