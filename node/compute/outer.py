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
loops, ``_accumulate``). Aggregation holds one tensor's sums and counts at a time, never a dense
copy per peer, and only the selected entries of the parameters are touched.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import numba
import numpy as np
import torch

from node.compute.robust import Screening, value_bound
from protocol.codec import Payload, SparseTensor, encode


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
    error: Mapping[str, torch.Tensor], *, topk: int, tile: int, **header: object
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Encode the error buffer and subtract what was sent from it, in place.

    Returns the payload bytes and the dense reconstruction ``c_hat`` (keep it: step 9 adds it
    back if this payload is not aggregated). ``header`` goes to ``protocol.codec.encode``
    (run_id, round, node_id, base).
    """
    data, recon = encode(error, topk=topk, tile=tile, **header)  # type: ignore[arg-type]
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


@numba.njit(cache=True, nogil=True)
def _accumulate(sums, counts, touched, n_touched, index, codes, table):
    # One peer's contribution: its values into the sums, one into the counts, and every entry
    # seen for the first time appended to ``touched``. Indices are distinct within a peer.
    for j in range(index.size):
        i = index[j]
        if counts[i] == 0:
            touched[n_touched] = i
            n_touched += 1
        sums[i] += table[codes[j]]
        counts[i] += 1
    return n_touched


@numba.njit(cache=True, nogil=True)
def _take_mean(sums, counts, touched, mean):
    # fp32 mean of every touched entry; the buffers are left all zero again.
    for j in range(touched.size):
        i = touched[j]
        mean[j] = sums[i] / np.float32(counts[i])
        sums[i] = 0.0
        counts[i] = 0


@numba.njit(cache=True, nogil=True)
def _subtract_at(theta, index, update):
    # theta[index] -= update, one fp32 subtraction per entry (update already holds alpha).
    for j in range(index.size):
        theta[index[j]] -= update[j]


class _Scratch:
    """Dense sum and count buffers reused from tensor to tensor.

    They are zero between uses: after each tensor only the touched entries are cleared again,
    so aggregating a whole model writes about as much memory as the payloads select, and holds
    one tensor-sized set of buffers at a time.
    """

    def __init__(self) -> None:
        self.sums = np.zeros(0, dtype=np.float32)
        self.counts = np.zeros(0, dtype=np.int32)
        self.touched = np.zeros(0, dtype=np.int64)
        self.pos = np.zeros(0, dtype=np.uint64)
        self.neg = np.zeros(0, dtype=np.uint64)

    def reserve(self, size: int) -> None:
        if self.sums.size < size:
            self.sums = np.zeros(size, dtype=np.float32)
            self.counts = np.zeros(size, dtype=np.int32)
            self.touched = np.zeros(size, dtype=np.int64)
            self.pos = np.zeros(size, dtype=np.uint64)
            self.neg = np.zeros(size, dtype=np.uint64)


def sparse_mean(
    parts: Sequence[SparseTensor],
    *,
    clip: bool = True,
    bound: bool = False,
    scratch: _Scratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over contributors of one tensor, as ``(index, mean)`` over the touched entries.

    ``parts`` must already be in the canonical (sorted node id) order. ``index`` (int64,
    row-major into the flattened tensor, each entry once, in order of first selection) lists
    every entry some peer selected; every other entry of the aggregate is 0. With ``clip``,
    each peer's tensor is first scaled by ``min(1, median_norm / its_norm)``; with ``bound``,
    every value is then clipped to ``node.compute.robust.value_bound`` (bounded influence).
    """
    if not parts:
        raise ValueError("aggregation needs at least one payload")
    geometry = parts[0].geometry
    for p in parts[1:]:
        if p.geometry != geometry:
            raise ValueError(f"tensor {p.name!r}: peers disagree on the tile geometry")
    scratch = scratch or _Scratch()
    scratch.reserve(geometry.numel)
    norms = [math.sqrt(p.sq_norm()) for p in parts] if clip or bound else []
    scales = _clip_scales(norms) if clip else [1.0] * len(parts)
    limit = value_bound(norms, geometry.n_kept) if bound else math.inf
    n = 0
    for part, scale in zip(parts, scales, strict=True):
        table = part.table
        if scale != 1.0:
            table = table * torch.tensor(scale, dtype=torch.float32)
        if limit != math.inf:
            edge = torch.tensor(limit, dtype=torch.float32)
            table = torch.minimum(torch.maximum(table, -edge), edge)
        # Peers are added one after another in canonical order, each entry at most once per
        # peer, so every sum is formed in the same order on every node.
        n = _accumulate(
            scratch.sums,
            scratch.counts,
            scratch.touched,
            n,
            part.index.numpy(),
            part.codes.numpy(),
            table.numpy(),
        )
    index = scratch.touched[:n].copy()
    mean = np.empty(n, dtype=np.float32)
    _take_mean(scratch.sums, scratch.counts, index, mean)
    return torch.from_numpy(index), torch.from_numpy(mean)


def aggregate_tensor(parts: Sequence[SparseTensor], *, clip: bool = True) -> torch.Tensor:
    """Mean over contributors of one tensor, as a dense fp32 tensor of the tensor's shape.

    A coordinate nobody selected is 0. See ``sparse_mean`` for the rules.
    """
    index, mean = sparse_mean(parts, clip=clip)
    out = torch.zeros(parts[0].geometry.numel, dtype=torch.float32)
    out[index] = mean
    return out.view(parts[0].geometry.shape)


def ordered(payloads: Mapping[str, Payload]) -> list[Payload]:
    """Payloads in the canonical aggregation order: sorted by node id."""
    return [payloads[node] for node in sorted(payloads)]


def apply_aggregate(
    params: Mapping[str, torch.Tensor],
    payloads: Mapping[str, Payload],
    *,
    alpha: float = 1.0,
    clip: bool = True,
    robust: bool = False,
) -> Screening:
    """Steps 7-8 in place: ``theta -= alpha * aggregate`` for every tensor.

    ``payloads`` maps node id to its validated payload; the mapping's own order is ignored.
    With no payloads the parameters stay unchanged (an empty round). Only the entries some
    peer selected change; elsewhere the aggregate is 0 and ``theta - 0`` is ``theta``. With
    ``robust``, the peers are first screened by their sign agreement over the whole payload and
    every value is bounded (``node.compute.robust``); the returned ``Screening`` says who was
    left out, and why.
    """
    names = sorted(payloads)
    peers = [payloads[node] for node in names]
    screening = Screening(names)
    if not peers:
        return screening
    scratch = _Scratch()
    if robust and screening.active:
        # First pass: every tensor's pairwise sign agreement (each decoded once more when the
        # payloads are lazy), then one verdict per peer for the whole payload.
        for name in params:
            parts = [p.tensors[name] for p in peers]
            scratch.reserve(parts[0].geometry.numel)
            screening.add(parts, scratch.pos, scratch.neg)
        keep = screening.decide()
        peers = [p for p, kept in zip(peers, keep, strict=True) if kept]
    with torch.no_grad():
        for name, theta in params.items():
            parts = [p.tensors[name] for p in peers]
            index, update = sparse_mean(parts, clip=clip, bound=robust, scratch=scratch)
            if alpha != 1.0:
                update.mul_(alpha)
            if (
                theta.dtype == torch.float32
                and theta.is_contiguous()
                and theta.device.type == "cpu"
            ):
                _subtract_at(theta.detach().view(-1).numpy(), index.numpy(), update.numpy())
            else:
                flat = theta.view(-1)
                flat[index] = flat[index] - update.to(device=theta.device, dtype=theta.dtype)
    return screening
