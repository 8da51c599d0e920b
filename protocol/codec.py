"""The SparseLoCo codec: chunk-wise Top-k, 2-bit quantisation and index coding of tensors.

Public API (used by the node, the benchmarks and outside checks; names and meanings are stable):

- ``encode(tensors, *, topk=64, tile=64, out=None, **header)`` compresses every tensor and
  returns the payload bytes together with the dense fp32 reconstruction of what was sent (the
  caller subtracts it from its error-feedback buffer), written into ``out``'s buffers where
  given; ``header`` is the ``HeaderFields`` (run_id, round, node_id, base, steps, tokens).
- ``encode_records(tensors, ...)`` and ``assemble(records, ...)`` are ``encode`` in two steps,
  for a node of several processes: each rank encodes its own tensors' records (shipped to rank
  0 with ``protocol.envelope.records_to_bytes``), rank 0 assembles them into the payload, the
  same bytes ``encode`` of all the tensors gives.
- ``decode(data, shapes)`` returns that same reconstruction, bit for bit, from the bytes.
- ``read_payload(data, shapes, only=...)``, ``read_payload_file`` and ``read_payload_ranges``
  validate a payload and return it in sparse form (``SparseTensor`` per tensor) for aggregation
  without densifying each peer; with ``only``, the header is checked against the whole model
  but only those tensors' records are read (``protocol.payload_reader``; the keywords they
  share are ``ReadOptions``).
- ``payload_base(data, shapes)`` is the header's ``base``, ``payload_work`` its steps and
  tokens; ``header_limit(shapes)`` the largest header a valid payload for the model has.

Each record's 2-bit codes go out raw or as one zstd frame, whichever is shorter
(``protocol.envelope.store_codes``, decided where the record is encoded, so ``assemble`` and
the device encoder give the same bytes); readers decompress only the records they read.

Every malformed input raises ``PayloadError`` naming the field. Validation happens before any
allocation that depends on the payload's own claims: sizes are checked against limits derived
from ``shapes``, which come from the run's model, never from the payload.

Selection: the kept positions of a tile are exactly its ``k`` largest entries by magnitude, ties
broken towards the lower position, so the payload is a deterministic function of the input. The
selection and the index coding run as compiled loops (``protocol.kernels``,
``protocol.rice_kernels``). Encoding runs on ``kernels.map_threads``' threads in two steps: the
Top-k of every tensor's tiles, in pieces, then each tensor's quantiser, reconstruction and index
coding, tensors side by side; the bytes are those of one thread doing it all in name order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypedDict, Unpack

import numpy as np
import torch

from protocol import kernels
from protocol.envelope import (
    MAX_DIMS,
    MAX_ROUND,
    MAX_STEPS,
    MAX_TEXT,
    MAX_TOKENS,
    Envelope,
    TensorRecord,
    pack_envelope,
)
from protocol.errors import CodecError
from protocol.indexcode import encode_positions
from protocol.payload_reader import (
    ReadOptions,
    _LazyTensors,
    header_limit,
    payload_base,
    payload_work,
    read_payload,
    read_payload_file,
    read_payload_ranges,
)
from protocol.quantize import pack_codes, quantize
from protocol.sparse import Payload, SparseTensor
from protocol.tiles import TileGeometry, check_codec_params

__all__ = [
    "DEFAULT_TILE",
    "DEFAULT_TOPK",
    "HeaderFields",
    "Payload",
    "ReadOptions",
    "SparseTensor",
    "_LazyTensors",
    "assemble",
    "decode",
    "encode",
    "encode_records",
    "encode_tensor",
    "header_limit",
    "payload_base",
    "payload_work",
    "read_payload",
    "read_payload_file",
    "read_payload_ranges",
]

DEFAULT_TOPK = 64
DEFAULT_TILE = 64


# --------------------------------------------------------------------------- encoding


def _recon_buffer(out: torch.Tensor | None, g: TileGeometry) -> torch.Tensor:
    """``out`` when the reconstruction can be written into it (a contiguous fp32 CPU tensor of
    the tensor's shape), else a new tensor; every entry is written by the caller.

    Reusing last round's buffer is most of what a memory copy costs less than a fresh
    tensor: the first touch of 330 MB of new pages at 81 M was a third of encode's time.
    """
    if (
        out is not None
        and out.dtype == torch.float32
        and out.device.type == "cpu"
        and tuple(out.shape) == g.shape
        and out.is_contiguous()
    ):
        return out
    return torch.empty(g.shape, dtype=torch.float32)


def encode_tensor(
    x: torch.Tensor, geometry: TileGeometry, name: str, *, out: torch.Tensor | None = None
) -> tuple[TensorRecord, torch.Tensor]:
    """Compress one tensor; returns its record and its dense fp32 reconstruction, written into
    ``out`` (and ``out`` returned) when it is a contiguous fp32 CPU tensor of the right shape.
    """
    return _encode_all([(name, x, geometry, out)])[0]


#: One tensor to encode: its name, values, geometry and the buffer for its reconstruction.
_Job = tuple[str, torch.Tensor, TileGeometry, torch.Tensor | None]
#: One tensor's kept entries, tile by tile: positions in the tile (n_tiles, k), values.
_Kept = tuple[torch.Tensor, torch.Tensor]


def _encode_all(jobs: list[_Job]) -> list[tuple[TensorRecord, torch.Tensor]]:
    """Records and reconstructions of ``jobs``, in their order, on ``kernels.map_threads``'
    threads: first the Top-k of every tensor's tiles, then each tensor's quantiser,
    reconstruction and index coding, tensors side by side (the largest first). Raises
    ``CodecError`` for the first tensor, in order, that cannot be encoded."""
    xs = [x.detach().to(torch.float32).contiguous() for _, x, _, _ in jobs]
    gs = [g for _, _, g, _ in jobs]
    picked = [i for i, g in enumerate(gs) if g.n_tiles and g.k < g.tile_len]
    selected = kernels.select_topk_many(
        [(xs[i].view(gs[i].rows, gs[i].cols).numpy(), gs[i].h, gs[i].w, gs[i].k) for i in picked]
    )
    kept: list[_Kept | None] = [None] * len(jobs)
    for i, (pos, _, vals, finite) in zip(picked, selected, strict=True):
        if not finite:
            raise CodecError(f"tensor {jobs[i][0]!r} contains NaN or infinite values")
        kept[i] = torch.from_numpy(pos), torch.from_numpy(vals)
    for i, g in enumerate(gs):
        if g.n_tiles and g.k >= g.tile_len and not bool(torch.isfinite(xs[i]).all()):
            raise CodecError(f"tensor {jobs[i][0]!r} contains NaN or infinite values")

    def finish(i: int) -> tuple[TensorRecord, torch.Tensor]:
        # Where every entry is kept, the values are gathered here, one tensor at a time.
        return _finish(jobs[i][0], gs[i], kept[i] or _everything(xs[i], gs[i]), jobs[i][3])

    return kernels.map_threads(finish, range(len(jobs)), cost=[g.numel for g in gs])


def _everything(x: torch.Tensor, g: TileGeometry) -> _Kept | None:
    """Every entry as kept, tile by tile (a tile that keeps all it has); None without tiles."""
    if not g.n_tiles:
        return None
    positions = torch.arange(g.tile_len, dtype=torch.int64).expand(g.n_tiles, g.tile_len)
    return positions, x.view(-1)[g.flat_index(positions)]


def _finish(
    name: str, g: TileGeometry, kept: _Kept | None, out: torch.Tensor | None
) -> tuple[TensorRecord, torch.Tensor]:
    """One tensor's record and reconstruction from its kept entries (None: no tiles)."""
    if kept is None:
        q = quantize(torch.zeros(0))
        recon = torch.zeros(g.shape, dtype=torch.float32)
        return TensorRecord(name, g.shape, 0, q.stats_bytes(), b"", b"", b""), recon
    positions, values = kept
    q = quantize(values)
    if not bool(torch.isfinite(q.table()).all()):
        # Near the top of the fp32 range a level or level + shift overflows; such a buffer
        # means training diverged, and a payload the decoders would reject helps nobody.
        raise CodecError(f"tensor {name!r}: values too large to quantise in fp32")
    recon = _recon_buffer(out, g)
    recon_np = recon.numpy().reshape(g.rows, g.cols)  # every entry written below
    pos_np = np.ascontiguousarray(positions.numpy())
    kernels.fill_dense(recon_np, pos_np, q.codes.numpy(), q.table().numpy(), g.h, g.w)
    rice_bits, unary, rem = encode_positions(positions)
    record = TensorRecord.of(
        name, g.shape, rice_bits, q.stats_bytes(), pack_codes(q.codes), unary, rem
    )
    return record, recon


class HeaderFields(TypedDict, total=False):
    """The header fields that say whose payload it is (keywords of ``encode`` and
    ``assemble``, declared once); each may be left out: "" for the strings, 0 for the numbers.

    ``run_id`` and ``node_id`` name the run and the sender, ``round`` the round it belongs to
    and ``base`` the fingerprint of the parameters it was trained from; ``steps`` and
    ``tokens`` the work it carries (inner steps trained in the round, the tokens they read).
    """

    run_id: str
    round: int
    node_id: str
    base: str
    steps: int
    tokens: int


def _uint(name: str, value: object, upper: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= upper:
        raise CodecError(f"{name} must be an int in [0, {upper}], got {value!r}")


def _header(
    *,
    run_id: str = "",
    round: int = 0,
    node_id: str = "",
    base: str = "",
    steps: int = 0,
    tokens: int = 0,
) -> tuple[str, int, str, str, int, int]:
    """The fields of a ``HeaderFields`` with their defaults, in envelope order, checked: a
    value the decoder would reject is refused here, so we never emit an unreadable payload."""
    for field, value in (("run_id", run_id), ("node_id", node_id), ("base", base)):
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise CodecError(f"{field} must be a str of at most {MAX_TEXT} characters")
    _uint("round", round, MAX_ROUND)
    _uint("steps", steps, MAX_STEPS)
    _uint("tokens", tokens, MAX_TOKENS)
    return run_id, round, node_id, base, steps, tokens


def encode_records(
    tensors: Mapping[str, torch.Tensor],
    *,
    topk: int = DEFAULT_TOPK,
    tile: int = DEFAULT_TILE,
    out: Mapping[str, torch.Tensor] | None = None,
) -> tuple[list[TensorRecord], dict[str, torch.Tensor]]:
    """Compress each tensor of ``tensors`` into its record, in sorted name order.

    Returns ``(records, reconstruction)``; ``assemble`` turns records (these, or the union of
    several ranks' disjoint sets) into the payload. ``out`` may hold buffers (e.g. an earlier
    round's reconstruction, no longer needed) that the reconstruction is written into, by name
    (``encode_tensor``). Raises ``CodecError`` for non-finite values, bad ``topk``/``tile``, or
    names and shapes the format cannot carry.
    """
    check_codec_params(topk, tile)
    jobs: list[_Job] = []
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
        jobs.append((name, x.cpu(), geometry, None if out is None else out.get(name)))
    done = _encode_all(jobs)
    return [r for r, _ in done], {job[0]: recon for job, (_, recon) in zip(jobs, done, strict=True)}


def assemble(
    records: Iterable[TensorRecord],
    *,
    topk: int = DEFAULT_TOPK,
    tile: int = DEFAULT_TILE,
    **header: Unpack[HeaderFields],
) -> bytes:
    """The payload of ``records`` (every tensor of the model, in any order, each once) with
    these ``header`` fields. Raises ``CodecError`` for a repeated name or a bad header field."""
    check_codec_params(topk, tile)
    run_id, round_, node_id, base, steps, tokens = _header(**header)
    ordered = tuple(sorted(records, key=lambda r: r.name))
    envelope = Envelope(run_id, round_, node_id, base, tile, topk, steps, tokens, ordered)
    return pack_envelope(envelope)


def encode(
    tensors: Mapping[str, torch.Tensor],
    *,
    topk: int = DEFAULT_TOPK,
    tile: int = DEFAULT_TILE,
    out: Mapping[str, torch.Tensor] | None = None,
    **header: Unpack[HeaderFields],
) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Compress every tensor of ``tensors`` into one payload.

    Returns ``(payload_bytes, reconstruction)``: the reconstruction maps each name to the dense
    fp32 tensor (same shape) that ``decode`` will rebuild, bit for bit, written into ``out[name]``
    where that is a contiguous fp32 CPU tensor of the shape (reusing a buffer spares the page
    faults of a new one). Tensors are written in sorted name order. ``run_id``, ``round``,
    ``node_id`` and ``base`` (the fingerprint of the parameters trained from) go into the
    header, with ``steps`` and ``tokens`` (the work it carries). Raises ``CodecError`` for
    non-finite values or bad ``topk``/``tile``.
    """
    _header(**header)  # checked before the work
    records, recon = encode_records(tensors, topk=topk, tile=tile, out=out)
    return assemble(records, topk=topk, tile=tile, **header), recon


# --------------------------------------------------------------------------- decoding


def decode(data: bytes, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """The dense fp32 reconstruction of every tensor, identical to what ``encode`` returned."""
    payload = read_payload(data, shapes)
    return {name: t.dense() for name, t in payload.tensors.items()}
