"""Robust aggregation: which peers' payloads count, and how much any one of them can move θ.

The network is untrusted: anyone holding a token can submit a payload that decodes fine but
pushes θ the wrong way (an honest update with its signs flipped, noise at an honest scale, a few
entries at huge magnitude). Two defences run inside every aggregation:

- **Sign-agreement screening**, per payload. For every pair of peers (p, q) and every entry both
  selected, count whether the signs of their values agree (+1) or not (-1); an entry p selected
  with a zero value counts as not agreeing with anyone (0). Summed over all tensors this gives
  ``A[p][q]`` agreements out of ``C[p][q]`` shared entries. A peer's score is the lower of two
  views of its agreement with the peers still in: pooled, ``Σ_q A[p][q] / Σ_q C[p][q]`` (needs
  ``MIN_EVIDENCE`` shared entries), and the median over those peers of ``A[p][q] / C[p][q]``
  (each pair with ``MIN_PAIR_EVIDENCE`` shared entries), so that attackers agreeing with each
  other cannot vouch for one another while they are a minority. Honest peers agree on almost
  every shared entry (0.93-1.00 on the tiny model); a sign-flipped update scores about -1,
  noise about 0, an update that puts its weight on a few entries 0 or below. The worst-scoring
  peer is removed while its score is below half the median score of those still in, then the
  scores are recomputed without it. At least three peers are needed: with two, each is judged
  only by the other, and neither can be told from its accuser. Up to ``MAX_SCREENED`` peers are
  screened (one bit each per entry); beyond that, all are kept.
- **Bounded influence**, per tensor (``value_bound``). After median-norm clipping, every value
  a peer sends is clipped to ``VALUE_BOUND`` times the typical magnitude of a kept entry at the
  median norm (``median_norm / sqrt(n_kept)``). A tensor holds only four distinct values (the
  2-bit table), so this clips four numbers; an honest table's extreme levels lie far inside.

Verdicts are exact and the same on every honest node: signs are small integers, scores are
compared as fractions, ties go to the lower node id, and the thresholds are constants. So the
parameters stay bit-identical whoever screens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numba
import numpy as np
from numba.typed import List

from protocol.codec import SparseTensor

#: Shared entries a peer needs with the others before its agreement can exclude it.
MIN_EVIDENCE = 64
#: Shared entries a pair of peers needs before their agreement counts on its own.
MIN_PAIR_EVIDENCE = 16
#: Peers needed before anyone is screened (with two, each is judged only by the other).
MIN_PEERS = 3
#: Most peers screened (one bit of a 64-bit mask each).
MAX_SCREENED = 64
#: A peer is out when its score is below this fraction of the median score of those still in.
SCORE_FRACTION = Fraction(1, 2)
#: Values are clipped to this many times ``median_norm / sqrt(n_kept)``.
VALUE_BOUND = 8.0


@numba.njit(cache=True, nogil=True)
def _pairs(pos, neg, index, codes, signs, p, lo, hi, base, agree, shared):
    # Peer p's agreement with every other peer on the entries p selected in one band.
    n = agree.shape[0]
    one = np.uint64(1)
    mine = one << np.uint64(p)
    for j in range(lo, hi):
        i = index[j] - base
        s = signs[codes[j]]
        if s > 0:
            same, other = pos[i] & ~mine, neg[i]
        elif s < 0:
            same, other = neg[i] & ~mine, pos[i]
        else:
            same, other = np.uint64(0), (pos[i] | neg[i]) & ~mine
        if same == 0 and other == 0:
            continue
        for q in range(n):
            b = one << np.uint64(q)
            if same & b:
                agree[p, q] += 1
                shared[p, q] += 1
            elif other & b:
                if s != 0:
                    agree[p, q] -= 1
                shared[p, q] += 1


@numba.njit(cache=True, nogil=True)
def _screen(indices, codes, signs, n_bands, kept, size, agree, shared):
    # Band by band (see node.compute.outer._bands): each entry's masks of the peers that sent
    # it a positive / negative value, then every peer's agreement with the others; the masks
    # cover one band and are cleared after it. Peer p keeps ``kept[p]`` entries per band.
    pos = np.zeros(size, dtype=np.uint64)
    neg = np.zeros(size, dtype=np.uint64)
    n = len(indices)
    for b in range(n_bands):
        base = b * size
        for p in range(n):
            bit = np.uint64(1) << np.uint64(p)
            index = indices[p]
            code = codes[p]
            lo = b * kept[p]
            for j in range(lo, lo + kept[p]):
                s = signs[p, code[j]]
                if s > 0:
                    pos[index[j] - base] |= bit
                elif s < 0:
                    neg[index[j] - base] |= bit
        for p in range(n):
            lo = b * kept[p]
            hi = lo + kept[p]
            _pairs(pos, neg, indices[p], codes[p], signs[p], p, lo, hi, base, agree, shared)
        for p in range(n):
            index = indices[p]
            for j in range(b * kept[p], (b + 1) * kept[p]):
                pos[index[j] - base] = 0
                neg[index[j] - base] = 0


@dataclass
class Screening:
    """Pairwise sign agreement of one aggregation's peers, and the verdicts drawn from it."""

    names: list[str]
    agree: np.ndarray = field(init=False)
    shared: np.ndarray = field(init=False)
    #: Peers screened out, with the reason (what the node reports about them).
    rejected: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.names)
        self.agree = np.zeros((n, n), dtype=np.int64)
        self.shared = np.zeros((n, n), dtype=np.int64)

    @property
    def active(self) -> bool:
        return MIN_PEERS <= len(self.names) <= MAX_SCREENED

    def add(self, parts: Sequence[SparseTensor]) -> None:
        """Account one tensor (``parts`` in the order of ``names``), one band of tiles at a
        time: scratch is 16 bytes per element of a band, not of the tensor."""
        if not self.active or not parts or not any(p.geometry.n_kept for p in parts):
            return
        g = parts[0].geometry
        gr, gc = g.grid
        kept = np.array([gc * p.geometry.k for p in parts], dtype=np.int64)
        signs = np.stack([np.sign(p.table.numpy()).astype(np.int32) for p in parts])
        indices, codes = List(), List()
        index_dtype = np.int64 if g.numel >= 2**31 else np.int32
        for p in parts:
            indices.append(p.index.numpy().astype(index_dtype, copy=False))
            codes.append(p.codes.numpy())
        _screen(indices, codes, signs, gr, kept, g.h * g.cols, self.agree, self.shared)

    def decide(self) -> list[bool]:
        """Which peers stay (in the order of ``names``); fills ``rejected``."""
        n = len(self.names)
        keep = [True] * n
        if not self.active:
            return keep
        while sum(keep) > MIN_PEERS - 1:
            inside = [q for q in range(n) if keep[q]]
            scores: dict[int, Fraction] = {}
            for p in inside:
                others = [q for q in inside if q != p]
                shared = int(self.shared[p, others].sum())
                if shared < MIN_EVIDENCE:
                    continue
                score = Fraction(int(self.agree[p, others].sum()), shared)
                pairs = [
                    Fraction(int(self.agree[p, q]), int(self.shared[p, q]))
                    for q in others
                    if self.shared[p, q] >= MIN_PAIR_EVIDENCE
                ]
                if len(pairs) >= MIN_PEERS - 1:
                    score = min(score, _median(pairs))
                scores[p] = score
            if len(scores) < MIN_PEERS:
                break
            bar = SCORE_FRACTION * _median(list(scores.values()))
            worst = min(scores, key=lambda p: (scores[p], p))  # ties: the lower node id
            if scores[worst] >= bar:
                break
            keep[worst] = False
            self.rejected[self.names[worst]] = (
                f"screened: sign agreement {float(scores[worst]):+.2f} with the other peers"
                f" (the median is {float(_median(list(scores.values()))):+.2f})"
            )
        return keep


def _median(values: list[Fraction]) -> Fraction:
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def value_bound(norms: Sequence[float], n_kept: int) -> float:
    """The largest magnitude any kept value may carry: ``VALUE_BOUND`` times the typical
    magnitude of an entry of a tensor at the median norm (inf when nothing bounds it)."""
    if not norms or n_kept == 0:
        return math.inf
    ordered = sorted(norms)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    if median == 0.0:
        return math.inf
    return VALUE_BOUND * median / math.sqrt(n_kept)
