"""The codec and the aggregation on the training device, in torch operations, bit for bit.

``protocol.codec`` and ``node.compute.outer`` run on the CPU (numba loops). This module does the
same work with plain torch operations on whatever device the tensors live on, and produces the
same bytes and the same parameters (``tests/test_device.py`` compares the two on the CPU;
``tests/bench/gpu_check.py`` does it on CUDA):

- ``encode``: Top-k per tile with ties to the lower position, made exact by ranking an integer
  key (the fp32 bit pattern of ``|x|``, which orders non-negative floats, above the reversed
  position), then the sorted positions, the Rice-coded gaps (the parameter chosen from exact
  integer sums) and the dense reconstruction. The quantiser's statistics are the one part done
  on the host: the format defines them through numpy's float64 summation order, so the kept
  values (1/64 of the tensor at the default k) are copied over and ``protocol.quantize`` runs
  on them; the codes come back for the reconstruction.
- ``decode``: a payload is validated completely on the host first (``read_payload(...,
  lazy=True)`` walks every stream with every rule and materialises nothing); the device then
  turns the already valid streams into flat indices with bit unpacking and prefix sums.
- ``apply_aggregate``: per tensor and per band of tiles (``node.compute.bands``), the
  peers' values are added into band-sized sums one peer after another (``index_add_`` of
  distinct indices: one addition per entry, in peer order, so no atomics race), then
  ``sum / count``, the separate multiplication by alpha and the subtraction, all in fp32 as
  the CPU path does them. Norms for clipping come from code counts (exact integers) and the
  four-value tables, as ``SparseTensor.sq_norm`` computes them. Robust screening (integer sign
  agreement) runs on the host on the same decoded payloads (``node.compute.robust``); its
  verdicts are exact either way.

Where it runs: a node under torchrun on CUDA keeps each rank's θ and error buffer on that
rank's GPU (``node.compute.worker``), so its ranks encode their tensors with ``encode_tensor``
here and apply their part of every round with ``apply_aggregate`` here; the payload bytes and θ
are the same as the CPU's either way. A plain single process keeps θ on the CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Unpack

import torch

from node.compute.bands import bands
from node.compute.outer import DEFAULT_AGGREGATE, AggregateOptions, _clip_scales, screen
from node.compute.robust import Screening, value_bound
from node.compute.work import UNIT, PeerWeight
from protocol.codec import HeaderFields, Payload, _header, _LazyTensors
from protocol.envelope import Envelope, TensorRecord, pack_envelope
from protocol.errors import CodecError
from protocol.indexcode import MAX_RICE_BITS
from protocol.quantize import dequant_table, pack_codes, quantize, unpack_stats
from protocol.tiles import TileGeometry, check_codec_params

#: Most elements handled at once (a chunk of whole bands of tiles): bounds device scratch.
CHUNK = 1 << 22
_POS_BITS = 20  # tile positions fit in 20 bits (MAX_TILE**2 = 2**20)
_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def _chunks(g: TileGeometry) -> list[tuple[int, int]]:
    """Ranges ``[b0, b1)`` of bands, each at most ``CHUNK`` elements (one band at least)."""
    n_bands, _, size = bands(g)
    step = max(1, CHUNK // max(1, size))
    return [(b, min(n_bands, b + step)) for b in range(0, n_bands, step)]


def _pack_bits(bits: torch.Tensor) -> bytes:
    """A 0/1 uint8 tensor as bytes, most significant bit first, zero padded."""
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.int32, device=bits.device)
    packed = (bits.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)
    return packed.cpu().numpy().tobytes()


def _unpack_bits(data: bytes, device: torch.device) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else None
    if raw is None:
        return torch.zeros(0, dtype=torch.int64, device=device)
    shifts = torch.arange(7, -1, -1, device=device, dtype=torch.uint8)
    return ((raw.unsqueeze(1) >> shifts) & 1).view(-1).to(torch.int64)


# --------------------------------------------------------------------------- encoding


def _select(x: torch.Tensor, g: TileGeometry) -> torch.Tensor:
    """Ascending kept positions ``(n_tiles, k)`` of every tile of the matrix ``x``."""
    _, gc = g.grid
    out = []
    for b0, b1 in _chunks(g):
        rows = x[b0 * g.h : b1 * g.h]
        tiles = rows.reshape(b1 - b0, g.h, gc, g.w).permute(0, 2, 1, 3).reshape(-1, g.tile_len)
        # |x| as int32 bits orders like |x|; the low bits rank lower positions higher on ties.
        key = tiles.abs().view(torch.int32).to(torch.int64) << _POS_BITS
        key |= torch.arange(g.tile_len - 1, -1, -1, device=x.device, dtype=torch.int64)
        top = torch.topk(key, g.k, dim=1, sorted=False).values
        pos = (g.tile_len - 1) - (top & ((1 << _POS_BITS) - 1))
        out.append(pos.sort(dim=1).values)
    return torch.cat(out)


def _flat(positions: torch.Tensor, g: TileGeometry) -> torch.Tensor:
    """Row-major flat indices of tile positions ``(n_tiles, k)``."""
    _, gc = g.grid
    tile_id = torch.arange(g.n_tiles, device=positions.device, dtype=torch.int64)
    origin = (tile_id // gc) * (g.h * g.cols) + (tile_id % gc) * g.w
    r = positions // g.w
    return (origin.unsqueeze(1) + r * g.cols + (positions - r * g.w)).reshape(-1)


def _rice(positions: torch.Tensor) -> tuple[int, bytes, bytes]:
    """``protocol.rice_kernels.rice_encode`` in torch operations (exact integer arithmetic)."""
    n = positions.numel()
    prev = torch.cat([positions.new_full((positions.shape[0], 1), -1), positions[:, :-1]], 1)
    gaps = (positions - prev - 1).reshape(-1)
    mean = int(gaps.sum()) // n
    guess = max(0, mean.bit_length() - 1)
    best_b, best_cost = -1, 0
    for b in range(max(0, guess - 2), min(MAX_RICE_BITS, guess + 3) + 1):
        cost = n * (b + 1) + int((gaps >> b).sum())
        if best_b < 0 or cost < best_cost:
            best_b, best_cost = b, cost
    b = best_b
    q = gaps >> b
    ends = torch.cumsum(q + 1, 0) - 1  # the terminating one bit of each quotient
    unary = torch.zeros(best_cost - n * b, dtype=torch.uint8, device=gaps.device)
    unary[ends] = 1
    if b:
        shifts = torch.arange(b - 1, -1, -1, device=gaps.device, dtype=torch.int64)
        rem = (((gaps & ((1 << b) - 1)).unsqueeze(1) >> shifts) & 1).to(torch.uint8)
        rem_bytes = _pack_bits(rem.view(-1))
    else:
        rem_bytes = b""
    return b, _pack_bits(unary), rem_bytes


def encode_tensor(
    x: torch.Tensor, geometry: TileGeometry, name: str
) -> tuple[TensorRecord, torch.Tensor]:
    """``protocol.codec.encode_tensor`` on ``x``'s device: the same record, the same recon."""
    g = geometry
    x = x.detach().to(torch.float32).contiguous()
    recon = torch.zeros(g.numel, dtype=torch.float32, device=x.device)
    if g.n_tiles == 0:
        q = quantize(torch.zeros(0))
        return TensorRecord(name, g.shape, 0, q.stats_bytes(), b"", b"", b""), recon.view(g.shape)
    if not bool(torch.isfinite(x).all()):
        raise CodecError(f"tensor {name!r} contains NaN or infinite values")
    matrix = x.view(g.rows, g.cols)
    if g.k >= g.tile_len:
        positions = torch.arange(g.tile_len, device=x.device).expand(g.n_tiles, -1)
    else:
        positions = _select(matrix, g)
    flat = _flat(positions, g)
    values = x.view(-1)[flat]
    q = quantize(values.cpu())  # float64 statistics in numpy's order: see the docstring
    table = q.table()
    if not bool(torch.isfinite(table).all()):
        raise CodecError(f"tensor {name!r}: values too large to quantise in fp32")
    codes = q.codes.to(x.device, dtype=torch.int64)
    recon[flat] = table.to(x.device)[codes]
    rice_bits, unary, rem = _rice(positions)
    record = TensorRecord.of(
        name, g.shape, rice_bits, q.stats_bytes(), pack_codes(q.codes), unary, rem
    )
    return record, recon.view(g.shape)


def encode(
    tensors: Mapping[str, torch.Tensor],
    *,
    topk: int = 64,
    tile: int = 64,
    **header: Unpack[HeaderFields],
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """``protocol.codec.encode`` with the work on each tensor's own device (same bytes)."""
    check_codec_params(topk, tile)
    fields = _header(**header)
    records, recon = [], {}
    for name in sorted(tensors):
        x = tensors[name]
        if not isinstance(x, torch.Tensor) or x.is_complex() or not x.is_floating_point():
            raise CodecError(f"tensor {name!r} must be a real floating-point torch.Tensor")
        geometry = TileGeometry.of(tuple(x.shape), topk=topk, tile=tile)
        record, recon[name] = encode_tensor(x, geometry, name)
        records.append(record)
    run_id, round_, node_id, base, steps, tokens = fields
    envelope = Envelope(run_id, round_, node_id, base, tile, topk, steps, tokens, tuple(records))
    return pack_envelope(envelope), recon


# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class DeviceSparse:
    """One decoded tensor on the device: flat indices (int64), codes (int64), value table."""

    geometry: TileGeometry
    index: torch.Tensor
    codes: torch.Tensor
    table: torch.Tensor  # (4,) fp32 on the host: the norms and bounds are computed there

    def sq_norm(self) -> float:
        """``SparseTensor.sq_norm``: exact, from the code counts and the four values."""
        counts = torch.bincount(self.codes, minlength=4).tolist()
        table = [float(v) for v in self.table]
        return math.fsum(n * v * v for n, v in zip(counts, table, strict=True))


def decode_record(rec: TensorRecord, g: TileGeometry, device: torch.device) -> DeviceSparse:
    """Indices and codes of a record that ``read_payload`` has already validated."""
    n = g.n_kept
    table = dequant_table(*unpack_stats(rec.stats))
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return DeviceSparse(g, empty, empty, table)
    b = rec.rice_bits
    ends = torch.nonzero(_unpack_bits(rec.unary, device)).view(-1)
    q = ends - torch.cat([ends.new_full((1,), -1), ends[:-1]]) - 1
    gaps = q << b
    if b:
        bits = _unpack_bits(rec.remainders, device)[: n * b].view(n, b)
        gaps |= (bits << torch.arange(b - 1, -1, -1, device=device, dtype=torch.int64)).sum(1)
    positions = torch.cumsum((gaps + 1).view(g.n_tiles, g.k), 1) - 1
    codes = _unpack_bits(rec.codes, device).view(-1, 2)
    codes = (codes[:, 0] * 2 + codes[:, 1])[:n]
    return DeviceSparse(g, _flat(positions, g), codes, table)


def decode_payload(payload: Payload, device: torch.device | str) -> dict[str, DeviceSparse]:
    """Every tensor of a lazily read (hence fully validated) payload, decoded on ``device``."""
    tensors = payload.tensors
    if not isinstance(tensors, _LazyTensors):
        raise TypeError("decode on the device reads payloads with read_payload(..., lazy=True)")
    dev = torch.device(device)
    out = {}
    for name in tensors:
        rec = tensors.record(name)
        g = TileGeometry.of(rec.shape, topk=payload.topk, tile=payload.tile)
        out[name] = decode_record(rec, g, dev)
    return out


def decode(payload: Payload, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The dense fp32 reconstruction of every tensor on ``device`` (as ``codec.decode``)."""
    out = {}
    for name, t in decode_payload(payload, device).items():
        dense = torch.zeros(t.geometry.numel, dtype=torch.float32, device=t.index.device)
        dense[t.index] = t.table.to(dense.device)[t.codes]
        out[name] = dense.view(t.geometry.shape)
    return out


# --------------------------------------------------------------------------- aggregation


def _tables(
    parts: Sequence[DeviceSparse], clip: bool, bound: bool, weights: Sequence[PeerWeight] | None
) -> list[torch.Tensor]:
    """Each peer's four values after clipping and the bound: ``outer._peer_tables``."""
    norms = [math.sqrt(p.sq_norm()) for p in parts] if clip or bound else []
    pre = [1.0] * len(parts) if weights is None else [w.pre for w in weights]
    post = [1] * len(parts) if weights is None else [w.post for w in weights]
    if norms and any(s != 1.0 for s in pre):
        norms = [n * s for n, s in zip(norms, pre, strict=True)]
    scales = _clip_scales(norms) if clip else [1.0] * len(parts)
    densest = max(p.geometry.n_kept for p in parts)
    limit = value_bound(norms, densest) if bound else math.inf
    out = []
    for row, (part, scale) in enumerate(zip(parts, scales, strict=True)):
        table = part.table
        if pre[row] != 1.0:
            table = table * torch.tensor(pre[row], dtype=torch.float32)
        if scale != 1.0:
            table = table * torch.tensor(scale, dtype=torch.float32)
        if limit != math.inf:
            edge = torch.tensor(limit, dtype=torch.float32)
            table = torch.minimum(torch.maximum(table, -edge), edge)
        if post[row] != 1:
            table = table * torch.tensor(float(post[row]), dtype=torch.float32)
        out.append(table)
    return out


def subtract_mean(
    theta: torch.Tensor,
    parts: Sequence[DeviceSparse],
    *,
    alpha: float = 1.0,
    clip: bool = True,
    bound: bool = False,
    weights: Sequence[PeerWeight] | None = None,
) -> None:
    """``theta -= alpha * mean over contributors``, in place, band chunk by band chunk; each
    peer with its own k per tile, counted ``weights[p].post`` times (``node.compute.work``)."""
    g = parts[0].geometry
    if not any(p.geometry.n_kept for p in parts):
        return
    dev = theta.device
    tables = [t.to(dev) for t in _tables(parts, clip, bound, weights)]
    counted = [1] * len(parts) if weights is None else [w.post for w in weights]
    _, _, size = bands(g)
    gc = g.grid[1]
    flat = theta.view(-1)
    for b0, b1 in _chunks(g):
        span = (b1 - b0) * size
        sums = torch.zeros(span, dtype=torch.float32, device=dev)
        counts = torch.zeros(span, dtype=torch.int32, device=dev)
        for part, table, w in zip(parts, tables, counted, strict=True):
            kept = gc * part.geometry.k
            index = part.index[b0 * kept : b1 * kept] - b0 * size
            sums.index_add_(0, index, table[part.codes[b0 * kept : b1 * kept]])
            counts.index_add_(0, index, torch.full_like(index, w, dtype=torch.int32))
        touched = torch.nonzero(counts).view(-1)
        mean = sums[touched] / counts[touched].to(torch.float32)
        if alpha != 1.0:
            mean = mean * alpha
        where = touched + b0 * size
        flat[where] = flat[where] - mean


def apply_aggregate(
    params: Mapping[str, torch.Tensor],
    payloads: Mapping[str, Payload],
    options: AggregateOptions = DEFAULT_AGGREGATE,
    work: Mapping[str, PeerWeight] | None = None,
) -> Screening:
    """``node.compute.outer.apply_aggregate`` on the parameters' device (fp32 parameters).

    ``payloads`` come from ``read_payload(..., lazy=True)``. Returns the same ``Screening``.
    """
    screening, ids = screen(
        params, payloads, robust=options.robust, combine=options.combine,
        each=lambda name, peers: [p.tensors[name] for p in peers],
    )  # fmt: skip
    if not payloads:
        return screening
    peers = [payloads[n] for n in ids]
    weights = None if work is None else [work.get(n, UNIT) for n in ids]
    with torch.no_grad():
        for name, theta in params.items():
            if theta.dtype != torch.float32 or not theta.is_contiguous():
                raise TypeError(f"parameter {name!r} must be a contiguous fp32 tensor")
            parts = []
            for p in peers:
                tensors = p.tensors
                if not isinstance(tensors, _LazyTensors):
                    raise TypeError("read payloads with read_payload(..., lazy=True)")
                rec = tensors.record(name)
                g = TileGeometry.of(rec.shape, topk=p.topk, tile=p.tile)
                parts.append(decode_record(rec, g, theta.device))
            subtract_mean(
                theta, parts, alpha=options.alpha, clip=options.clip, bound=options.robust,
                weights=weights,
            )  # fmt: skip
    return screening
