"""The SparseLoCo codec: chunk-wise Top-k, 2-bit quantisation and index coding of tensors.

Public API (used by the node, the benchmarks and outside checks; names and meanings are stable):

- ``encode(tensors, *, topk=64, tile=64)`` compresses every tensor and returns the payload bytes
  together with the dense fp32 reconstruction of what was sent (the caller subtracts it from its
  error-feedback buffer).
- ``decode(data, shapes)`` returns that same reconstruction, bit for bit, from the bytes.
- ``read_payload(data, shapes)`` validates a payload completely and returns it in sparse form
  (``SparseTensor`` per tensor) for aggregation without densifying each peer.

Every malformed input raises ``PayloadError`` naming the field. Validation happens before any
allocation that depends on the payload's own claims: sizes are checked against limits derived
from ``shapes``, which come from the run's model, never from the payload.

Selection: the kept positions of a tile are exactly its ``k`` largest entries by magnitude, ties
broken towards the lower position, so the payload is a deterministic function of the input. The
selection and the index decoding run as compiled loops (``protocol.kernels``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from protocol import kernels
from protocol.envelope import (
    MAX_DIMS,
    MAX_ROUND,
    MAX_TEXT,
    Envelope,
    TensorRecord,
    pack_envelope,
    unpack_envelope,
)
from protocol.errors import CodecError, PayloadError
from protocol.indexcode import check_index, decode_flat_index, encode_positions
from protocol.quantize import (
    STATS_SIZE,
    codes_canonical,
    count_codes,
    dequant_table,
    pack_codes,
    quantize,
    unpack_codes,
    unpack_stats,
)
from protocol.tiles import TileGeometry, check_codec_params

DEFAULT_TOPK = 64
DEFAULT_TILE = 64


@dataclass(frozen=True)
class SparseTensor:
    """One tensor of a decoded payload: where its kept values are, their codes, the value table.

    ``index`` holds the row-major indices into the flattened tensor, in the payload's order
    (tile by tile, ascending position inside each tile): exactly what aggregation scatters to.
    """

    name: str
    geometry: TileGeometry
    index: torch.Tensor  # (n_tiles * k,) int32 (int64 for tensors of 2**31 elements or more)
    codes: torch.Tensor  # (n_tiles * k,) uint8 in [0, 3]
    table: torch.Tensor  # (4,) fp32: the dequantised value of each code

    @property
    def positions(self) -> torch.Tensor:
        """Kept positions inside each tile, ``(n_tiles, k)`` ascending (int64)."""
        g = self.geometry
        idx = self.index.to(torch.int64)
        row, col = idx // g.cols, idx % g.cols
        return ((row % g.h) * g.w + col % g.w).view(g.n_tiles, g.k)

    def values(self) -> torch.Tensor:
        """The dequantised kept values, in the order of ``index``."""
        return self.table[self.codes.to(torch.int64)]

    def code_counts(self) -> list[int]:
        """How many kept values carry each of the four codes."""
        # A compiled count (nogil): torch's bincount cost about 50x more here.
        return [int(c) for c in count_codes(self.codes.numpy())]

    def sq_norm(self) -> float:
        """Exact squared L2 norm of the dequantised tensor, computed the same way everywhere.

        A tensor holds only four distinct values, so the norm is a four-term sum in float64:
        independent of thread count, SIMD width and summation order.
        """
        table = [float(v) for v in self.table]
        return math.fsum(n * v * v for n, v in zip(self.code_counts(), table, strict=True))

    def dense(self) -> torch.Tensor:
        """The dense fp32 tensor this sparse tensor stands for."""
        out = torch.zeros(self.geometry.numel, dtype=torch.float32)
        out[self.index.to(torch.int64)] = self.values()
        return out.view(self.geometry.shape)


@dataclass(frozen=True)
class Payload:
    """A validated payload: its header fields and every tensor in sparse form.

    ``tensors`` is a plain dict, or (``read_payload(..., lazy=True)``) a mapping that decodes a
    tensor each time it is looked up, so a consumer going tensor by tensor holds one decoded
    tensor per payload at a time.
    """

    run_id: str
    round: int
    node_id: str
    base: str
    tile: int
    topk: int
    tensors: Mapping[str, SparseTensor]


class _LazyTensors(Mapping[str, SparseTensor]):
    """The tensors of an already fully validated payload, decoded on each lookup (not kept)."""

    def __init__(self, env: Envelope, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._env = env
        self._shapes = shapes
        self._where = {rec.name: i for i, rec in enumerate(env.tensors)}

    def __getitem__(self, name: str) -> SparseTensor:
        i = self._where[name]
        rec = self._env.tensors[i]
        return _decode_record(rec, self._env, tuple(self._shapes[name]), f"tensors[{i}]")

    def record(self, name: str) -> TensorRecord:
        """The validated record of tensor ``name`` (for decoders elsewhere, e.g. on a GPU)."""
        return self._env.tensors[self._where[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


# --------------------------------------------------------------------------- encoding


def encode_tensor(
    x: torch.Tensor, geometry: TileGeometry, name: str
) -> tuple[TensorRecord, torch.Tensor]:
    """Compress one tensor; returns its record and its dense fp32 reconstruction."""
    x = x.detach().to(torch.float32).contiguous()
    g = geometry
    if g.n_tiles == 0:
        q = quantize(torch.zeros(0))
        recon = torch.zeros(g.shape, dtype=torch.float32)
        return TensorRecord(name, g.shape, 0, q.stats_bytes(), b"", b"", b""), recon
    recon_np = np.empty((g.rows, g.cols), dtype=np.float32)  # every entry written below
    if g.k >= g.tile_len:  # everything is kept
        if not bool(torch.isfinite(x).all()):
            raise CodecError(f"tensor {name!r} contains NaN or infinite values")
        positions = torch.arange(g.tile_len, dtype=torch.int64).expand(g.n_tiles, g.tile_len)
        flat = g.flat_index(positions)
        values = x.view(-1)[flat]
    else:
        pos, idx, vals, finite = kernels.select_topk(x.view(g.rows, g.cols).numpy(), g.h, g.w, g.k)
        if not finite:
            raise CodecError(f"tensor {name!r} contains NaN or infinite values")
        positions, flat, values = (
            torch.from_numpy(pos),
            torch.from_numpy(idx),
            torch.from_numpy(vals),
        )
    q = quantize(values)
    if not bool(torch.isfinite(q.table()).all()):
        # Near the top of the fp32 range a level or level + shift overflows; such a buffer
        # means training diverged, and a payload the decoders would reject helps nobody.
        raise CodecError(f"tensor {name!r}: values too large to quantise in fp32")
    pos_np = np.ascontiguousarray(positions.numpy())
    kernels.fill_dense(recon_np, pos_np, q.codes.numpy(), q.table().numpy(), g.h, g.w)
    recon = torch.from_numpy(recon_np).view(g.shape)
    rice_bits, unary, rem = encode_positions(positions)
    record = TensorRecord(
        name, g.shape, rice_bits, q.stats_bytes(), pack_codes(q.codes), unary, rem
    )
    return record, recon


def _check_header(*, run_id: object, round: object, node_id: object, base: object) -> None:
    """Refuse header values the decoder would reject, so we never emit an unreadable payload."""
    for field, value in (("run_id", run_id), ("node_id", node_id), ("base", base)):
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise CodecError(f"{field} must be a str of at most {MAX_TEXT} characters")
    if isinstance(round, bool) or not isinstance(round, int) or not 0 <= round <= MAX_ROUND:
        raise CodecError(f"round must be an int in [0, {MAX_ROUND}], got {round!r}")


def encode(
    tensors: Mapping[str, torch.Tensor],
    *,
    topk: int = DEFAULT_TOPK,
    tile: int = DEFAULT_TILE,
    run_id: str = "",
    round: int = 0,
    node_id: str = "",
    base: str = "",
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Compress every tensor of ``tensors`` into one payload.

    Returns ``(payload_bytes, reconstruction)``: the reconstruction maps each name to the dense
    fp32 tensor (same shape) that ``decode`` will rebuild, bit for bit. Tensors are written in
    sorted name order. ``run_id``, ``round``, ``node_id`` and ``base`` (the fingerprint of the
    parameters trained from) go into the header. Raises ``CodecError`` for non-finite values or
    bad ``topk``/``tile``.
    """
    check_codec_params(topk, tile)
    _check_header(run_id=run_id, round=round, node_id=node_id, base=base)
    records, recon = [], {}
    for name in sorted(tensors):
        x = tensors[name]
        if not isinstance(x, torch.Tensor) or x.is_complex() or not x.is_floating_point():
            raise CodecError(f"tensor {name!r} must be a real floating-point torch.Tensor")
        if not isinstance(name, str) or len(name) > MAX_TEXT or x.dim() > MAX_DIMS:
            raise CodecError(
                f"tensor {name!r}: names must be str of at most {MAX_TEXT} "
                f"characters and tensors have at most {MAX_DIMS} dimensions"
            )
        geometry = TileGeometry.of(tuple(x.shape), topk=topk, tile=tile)
        record, recon[name] = encode_tensor(x.cpu(), geometry, name)
        records.append(record)
    env = Envelope(run_id, round, node_id, base, tile, topk, tuple(records))
    return pack_envelope(env), recon


# --------------------------------------------------------------------------- decoding


def body_limit(shapes: Mapping[str, tuple[int, ...]]) -> int:
    """Largest body a valid payload for ``shapes`` can need: about one byte per parameter.

    Positions cost at most ~1.1 bits and codes 2 bits per parameter even at k = tile size, so a
    byte per parameter plus fixed overhead per tensor is generous and still bounded.
    """
    return 4096 + sum(1024 + math.prod(s) for s in shapes.values())


def _checked_record(
    rec: TensorRecord, env: Envelope, shape: tuple[int, ...], field: str
) -> tuple[TileGeometry, torch.Tensor]:
    """The record's geometry and value table, after checking its shape, stats and codes."""
    if rec.shape != tuple(shape):
        raise PayloadError(
            f"{field}.shape", f"{list(rec.shape)} differs from the model's {list(shape)}"
        )
    geometry = TileGeometry.of(rec.shape, topk=env.topk, tile=env.tile)
    if len(rec.stats) != STATS_SIZE:
        raise PayloadError(f"{field}.stats", f"expected {STATS_SIZE} bytes, got {len(rec.stats)}")
    shift, levels = unpack_stats(rec.stats)
    table = dequant_table(shift, levels)
    if not all(map(math.isfinite, (shift, *levels, *table.tolist()))):
        raise PayloadError(f"{field}.stats", "shift, levels and their sums must be finite")
    if not codes_canonical(rec.codes, geometry.n_kept):
        raise PayloadError(
            f"{field}.codes",
            f"expected {(geometry.n_kept + 3) // 4} bytes with zero padding, got {len(rec.codes)}",
        )
    return geometry, table


def _check_record(rec: TensorRecord, env: Envelope, shape: tuple[int, ...], field: str) -> None:
    """Every check ``_decode_record`` makes, without materialising indices or codes."""
    geometry, _ = _checked_record(rec, env, shape, field)
    check_index(rec.rice_bits, rec.unary, rec.remainders, geometry=geometry, field=field)


def _decode_record(
    rec: TensorRecord, env: Envelope, shape: tuple[int, ...], field: str
) -> SparseTensor:
    geometry, table = _checked_record(rec, env, shape, field)
    codes = unpack_codes(rec.codes, geometry.n_kept)
    if codes is None:  # pragma: no cover - _checked_record refused it already
        raise PayloadError(f"{field}.codes", "not canonical")
    # int32 indices keep G decoded peers small while they wait for aggregation.
    index = decode_flat_index(
        rec.rice_bits, rec.unary, rec.remainders, geometry=geometry, field=field
    )
    return SparseTensor(rec.name, geometry, index, torch.from_numpy(codes), table)


def read_payload(
    data: bytes,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    topk: int | None = None,
    tile: int | None = None,
    lazy: bool = False,
) -> Payload:
    """Validate ``data`` completely against the model's ``shapes`` and return it sparse.

    ``topk`` and ``tile``, when given, must match the payload's codec parameters (a run fixes
    them). Raises ``PayloadError`` naming the field for anything malformed.

    With ``lazy``, every tensor is checked here completely (the index streams are walked with
    every rule of the decoder, but nothing is materialised) and decoded once, on lookup in
    ``tensors``. Aggregating G peers tensor by tensor then holds the G payloads' bytes and one
    decoded tensor per peer, never G decoded models, and validation still completes before the
    caller applies anything.
    """
    env = unpack_envelope(data, max_body=body_limit(shapes))
    try:
        check_codec_params(env.topk, env.tile)
    except CodecError as exc:
        field = "body.topk" if str(exc).startswith("topk") else "body.tile"
        raise PayloadError(field, str(exc)) from exc
    if topk is not None and env.topk != topk:
        raise PayloadError("body.topk", f"payload uses k={env.topk}, the run uses {topk}")
    if tile is not None and env.tile != tile:
        raise PayloadError("body.tile", f"payload uses tile={env.tile}, the run uses {tile}")
    names = [r.name for r in env.tensors]
    expected = sorted(shapes)
    if names != expected:
        missing = sorted(set(expected) - set(names))
        extra = sorted(set(names) - set(expected))
        detail = (
            f"missing {missing[:3]}, unexpected {extra[:3]}"
            if missing or extra
            else ("not in sorted order or repeated")
        )
        raise PayloadError("body.tensors", f"tensor names do not match the model: {detail}")
    if lazy:
        kernels.map_threads(
            lambda i: _check_record(
                env.tensors[i], env, tuple(shapes[env.tensors[i].name]), f"tensors[{i}]"
            ),
            range(len(env.tensors)),
        )
        lazy_tensors = _LazyTensors(env, shapes)
        return Payload(
            env.run_id, env.round, env.node_id, env.base, env.tile, env.topk, lazy_tensors
        )
    tensors = {
        rec.name: _decode_record(rec, env, tuple(shapes[rec.name]), f"tensors[{i}]")
        for i, rec in enumerate(env.tensors)
    }
    return Payload(env.run_id, env.round, env.node_id, env.base, env.tile, env.topk, tensors)


def decode(data: bytes, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The dense fp32 reconstruction of every tensor, identical to what ``encode`` returned."""
    payload = read_payload(data, shapes)
    return {name: t.dense() for name, t in payload.tensors.items()}
