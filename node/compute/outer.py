"""The SparseLoCo outer step: error feedback, compression, sparse aggregation, outer SGD.

One round on a node, in DESIGN.md's numbering (inner training, step 1, is
``node.compute.optim``):

2. ``pseudo_gradient``: ``delta = theta_t - theta_i`` (a descent direction);
3. ``feed_error``: ``e = beta * e + delta``;
4-5. ``compress``: encode ``e`` and subtract what was sent, ``e -= c_hat``;
7. ``sparse_mean`` (dense: ``aggregate_tensor``): per coordinate, the mean over the payloads
   that selected it, with optional per-tensor clipping of each peer to the median norm;
8. ``apply_aggregate``: ``theta -= alpha * aggregate``;
9. ``add_back``: ``e += c_hat`` when the node's own payload was not in the gather set.

Determinism is the point of this module: every honest node must end each round with
bit-identical parameters. So peers are always taken in sorted node-id order, norms are computed
exactly (``SparseTensor.sq_norm``), every arithmetic step is a separate fp32 operation (no fused
multiply-add), and each peer is added in turn, one addition per entry it selected (compiled
loops, ``node.compute.bands``). Aggregation works one band of tiles at a time: its scratch is
a band's sums and counts per thread, never a dense copy of a tensor, let alone one per peer, and
only the selected entries of the parameters are touched. Bands are independent, so they run in
parallel without changing a single sum.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch

from node.compute.bands import band_means, kept_and_weights, peer_arrays, subtract_mean
from node.compute.bands import bands as _bands
from node.compute.robust import Screening, value_bound
from node.compute.work import UNIT, PeerWeight
from protocol import kernels
from protocol.codec import Payload, SparseTensor, encode
from protocol.tiles import TileGeometry


def pseudo_gradient(
    start: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``start - trained`` per tensor, fp32 (the direction the inner steps moved, negated)."""
    return {n: start[n].float() - trained[n].detach().float() for n in start}


def feed_error(
    error: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor], beta: float
) -> None:
    """In place: ``e = beta * e + delta`` (two separate operations)."""
    for name, e in error.items():
        e.mul_(beta)
        e.add_(delta[name])


def compress(
    error: Mapping[str, torch.Tensor],
    *,
    topk: int,
    tile: int,
    out: Mapping[str, torch.Tensor] | None = None,
    **header: object,
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Encode the error buffer and subtract what was sent from it, in place.

    Returns the payload bytes and the dense reconstruction ``c_hat`` (keep it: step 9 adds it
    back if this payload is not aggregated), written into ``out``'s buffers where given (an
    earlier round's ``c_hat`` nobody needs any more). ``header`` goes to
    ``protocol.codec.encode`` (run_id, round, node_id, base).
    """
    data, recon = encode(error, topk=topk, tile=tile, out=out, **header)  # type: ignore[arg-type]
    for name, e in error.items():
        e.sub_(recon[name])
    return data, recon


def add_back(error: Mapping[str, torch.Tensor], recon: Mapping[str, torch.Tensor]) -> None:
    """Step 9: return an unaggregated contribution to the error buffer (nothing is lost)."""
    for name, e in error.items():
        e.add_(recon[name])


def clip_scales(parts: Sequence[SparseTensor]) -> list[float]:
    """Per-peer factors ``min(1, median_norm / norm)`` for one tensor (1 for a zero norm)."""
    return _clip_scales([math.sqrt(p.sq_norm()) for p in parts])


def _clip_scales(norms: Sequence[float]) -> list[float]:
    median = statistics.median(norms)
    return [1.0 if n == 0.0 or n <= median else median / n for n in norms]


def same_grid(parts: Sequence[SparseTensor]) -> TileGeometry:
    """The tile grid every peer's record of one tensor shares; the first peer's geometry.

    Peers may keep different numbers of entries per tile (a node on a thin link sends fewer:
    ``node.compute.linkbudget``), never cut the tensor differently."""
    geometry = parts[0].geometry
    for p in parts[1:]:
        g = p.geometry
        if (g.shape, g.h, g.w) != (geometry.shape, geometry.h, geometry.w):
            raise ValueError(f"tensor {p.name!r}: peers disagree on the tile geometry")
    return geometry


def _peer_tables(
    parts: Sequence[SparseTensor],
    clip: bool,
    bound: bool,
    norms: Sequence[float] | None = None,
    weights: Sequence[PeerWeight] | None = None,
) -> np.ndarray:
    """Each peer's four values after median-norm clipping and the value bound, ``(G, 4)``.

    ``norms``: the parts' L2 norms when already known (``math.sqrt(part.sq_norm())``).
    ``weights`` (``node.compute.work``): a peer's ``pre`` scales its values before the clipping
    sees them (so the clipping bounds what the scaling may buy), its ``post`` multiplies them
    after the bound, for a contributor mean weighted by ``post``; each one fp32
    multiplication. The value bound takes the densest peer's kept count: a sparser payload
    earns no looser bound.
    """
    same_grid(parts)
    if norms is None:
        norms = [math.sqrt(p.sq_norm()) for p in parts] if clip or bound else []
    elif not (clip or bound):
        norms = []
    pre = [1.0] * len(parts) if weights is None else [w.pre for w in weights]
    post = [1] * len(parts) if weights is None else [w.post for w in weights]
    if norms and any(s != 1.0 for s in pre):
        norms = [n * s for n, s in zip(norms, pre, strict=True)]
    scales = _clip_scales(norms) if clip else [1.0] * len(parts)
    densest = max(p.geometry.n_kept for p in parts)
    limit = value_bound(norms, densest) if bound else math.inf
    tables = np.empty((len(parts), 4), dtype=np.float32)
    edge = np.float32(limit)
    for row, part in enumerate(parts):
        table = part.table.numpy()
        if pre[row] != 1.0:
            table = table * np.float32(pre[row])
        if scales[row] != 1.0:
            table = table * np.float32(scales[row])  # one fp32 multiplication, as in torch
        if limit != math.inf:
            table = np.minimum(np.maximum(table, -edge), edge)
        if post[row] != 1:
            table = table * np.float32(post[row])
        tables[row] = table
    return tables


def sparse_mean(
    parts: Sequence[SparseTensor],
    *,
    clip: bool = True,
    bound: bool = False,
    weights: Sequence[PeerWeight] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over contributors of one tensor, as ``(index, mean)`` over the touched entries.

    ``parts`` must already be in the canonical (sorted node id) order. ``index`` (int64,
    row-major into the flattened tensor, each entry once; band by band, inside a band in order
    of first selection) lists every entry some peer selected; every other entry of the aggregate
    is 0. With ``clip``, each peer's tensor is first scaled by ``min(1, median_norm /
    its_norm)``; with ``bound``, every value is then clipped to
    ``node.compute.robust.value_bound`` (bounded influence). ``weights`` (one per part,
    ``node.compute.work``): the mean of unequal work; None: every peer counts once.
    """
    if not parts:
        raise ValueError("aggregation needs at least one payload")
    tables = _peer_tables(parts, clip, bound, weights=weights)
    geometry = parts[0].geometry
    n_bands, _, size = _bands(geometry)
    kept, counts = kept_and_weights(parts, weights)
    cap = min(geometry.numel, sum(p.geometry.n_kept for p in parts))
    index = np.empty(cap, dtype=np.int64)
    mean = np.empty(cap, dtype=np.float32)
    if cap:
        indices, codes = peer_arrays(parts)
        n = band_means(indices, codes, tables, kept, counts, n_bands, size, index, mean)
    else:
        n = 0
    return torch.from_numpy(index[:n].copy()), torch.from_numpy(mean[:n].copy())


def _subtract_in_place(
    theta: torch.Tensor,
    parts: Sequence[SparseTensor],
    alpha: float,
    clip: bool,
    bound: bool,
    norms: Sequence[float] | None = None,
    weights: Sequence[PeerWeight] | None = None,
) -> None:
    """``theta -= alpha * mean`` for an fp32 contiguous CPU tensor, one band at a time."""
    tables = _peer_tables(parts, clip, bound, norms, weights)
    geometry = parts[0].geometry
    if not any(p.geometry.n_kept for p in parts):
        return
    n_bands, _, size = _bands(geometry)
    kept, counts = kept_and_weights(parts, weights)
    indices, codes = peer_arrays(parts)
    flat = theta.detach().view(-1).numpy()
    with kernels.parallel():
        chunks = min(n_bands, 4 * numba.get_num_threads())
        scaled = alpha != 1.0
        subtract_mean(
            flat, indices, codes, tables, kept, counts, n_bands, size, np.float32(alpha),
            scaled, chunks,
        )  # fmt: skip


def aggregate_tensor(
    parts: Sequence[SparseTensor],
    *,
    clip: bool = True,
    weights: Sequence[PeerWeight] | None = None,
) -> torch.Tensor:
    """Mean over contributors of one tensor, as a dense fp32 tensor of the tensor's shape.

    A coordinate nobody selected is 0. See ``sparse_mean`` for the rules.
    """
    index, mean = sparse_mean(parts, clip=clip, weights=weights)
    out = torch.zeros(parts[0].geometry.numel, dtype=torch.float32)
    out[index] = mean
    return out.view(parts[0].geometry.shape)


def _decoded(name: str, payload: Payload) -> tuple[SparseTensor, float]:
    part = payload.tensors[name]
    return part, math.sqrt(part.sq_norm())


def screen(
    names: Iterable[str],
    payloads: Mapping[str, Payload],
    *,
    robust: bool,
    combine: Callable[[np.ndarray], np.ndarray] | None,
    each: Callable[[str, list[Payload]], list[Any]],
) -> tuple[Screening, list[str]]:
    """The screening of ``payloads`` and the node ids of the peers it keeps, in canonical
    order (all of them without ``robust``). A first pass over the tensors ``names`` takes every
    tensor's pairwise sign agreement (``each(name, peers)``: the peers' records of the tensor,
    each decoded once more when the payloads are lazy), then one verdict per peer for the whole
    payload; ``combine`` adds the counts over a node's ranks first. Screening looks at signs
    only: how much work a peer's payload carries (``node.compute.work``) does not enter it."""
    ids = sorted(payloads)
    screening = Screening(ids)
    if not ids or not (robust and screening.active):
        return screening, ids
    peers = [payloads[n] for n in ids]
    for name in names:
        screening.add(each(name, peers))
    if combine is not None:
        screening.agree = combine(screening.agree)
        screening.shared = combine(screening.shared)
    keep = screening.decide()
    return screening, [n for n, kept in zip(ids, keep, strict=True) if kept]


@dataclass(frozen=True)
class AggregateOptions:
    """How a round's aggregate is applied (``apply_aggregate`` here and in ``node.compute.device``):
    scaled by ``alpha``, each peer's tensor clipped to the median norm (``clip``), the peers
    screened and the values bounded (``robust``); ``combine`` sums the screening's counts over
    a node's ranks (``Group.sum_ints``), None for one process."""

    alpha: float = 1.0
    clip: bool = True
    robust: bool = False
    combine: Callable[[np.ndarray], np.ndarray] | None = None


DEFAULT_AGGREGATE = AggregateOptions()


def apply_aggregate(
    params: Mapping[str, torch.Tensor],
    payloads: Mapping[str, Payload],
    options: AggregateOptions = DEFAULT_AGGREGATE,
    work: Mapping[str, PeerWeight] | None = None,
) -> Screening:
    """Steps 7-8 in place: ``theta -= alpha * aggregate`` for every tensor (``options``).

    ``work`` (node id -> ``PeerWeight``, ``node.compute.work.peer_weights``): how each peer's
    payload counts when the peers did unequal work; None (or a peer missing from it): once.

    ``payloads`` maps node id to its validated payload; the mapping's own order is ignored.
    With no payloads the parameters stay unchanged (an empty round). Only the entries some
    peer selected change; elsewhere the aggregate is 0 and ``theta - 0`` is ``theta``. With
    ``robust``, the peers are first screened by their sign agreement over the whole payload and
    every value is bounded (``node.compute.robust``); the returned ``Screening`` says who was
    left out, and why.

    On a node of several ranks ``params`` (and each payload's tensors) are this rank's share;
    ``combine`` adds the screening's integer counts over the ranks (``Group.sum_ints``, exact)
    before the verdicts, so every rank screens out the same peers.
    """
    alpha, clip, robust = options.alpha, options.clip, options.robust
    # Each tensor of the peers decoded side by side (nogil kernels) for the screening.
    screening, ids = screen(
        params, payloads, robust=robust, combine=options.combine,
        each=lambda name, peers: kernels.map_threads(lambda p: p.tensors[name], peers),
    )  # fmt: skip
    if not payloads:
        return screening
    peers = [payloads[n] for n in ids]
    weights = None if work is None else [work.get(n, UNIT) for n in ids]
    with torch.no_grad():
        for name, theta in params.items():
            # Lazily read payloads decode here, the peers side by side (nogil kernels).
            decoded = kernels.map_threads(functools.partial(_decoded, name), peers)
            parts = [part for part, _ in decoded]
            if (
                theta.dtype == torch.float32
                and theta.is_contiguous()
                and theta.device.type == "cpu"
            ):
                norms = [norm for _, norm in decoded]
                _subtract_in_place(theta, parts, alpha, clip, robust, norms, weights)
                continue
            index, update = sparse_mean(parts, clip=clip, bound=robust, weights=weights)
            if alpha != 1.0:
                update.mul_(alpha)
            flat = theta.view(-1)
            flat[index] = flat[index] - update.to(device=theta.device, dtype=theta.dtype)
    return screening
