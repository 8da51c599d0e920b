"""Reading a payload against the model: whole, or only some tensors' records.

A node may be several processes, each owning some of the model's tensors; each reads and checks
only its own tensors' records of a peer's payload. Checks come in two levels
(``protocol/FORMAT.md``, "Reading"):

- *header level*, for every reader whatever it reads, against *all* of the model's tensors: the
  codec parameters, the exact names in order, every shape, every entry's Rice parameter and
  declared lengths (derived from the model's geometry alone), and the payload's exact total
  size. So every reader, whole or partial, agrees on the offsets and on the header's validity
  before it touches a record.
- *record level*, for the records a reader reads: the CRC-32, finite statistics, the codes (a
  zstd frame decompressed only here, only for the records read, to exactly the size the
  geometry gives) and their padding, the index streams (exactly ``n_kept`` codes, positions
  inside their tiles, canonical padding).

Nothing whose size comes from the payload is read or allocated before it is bounded by the
model: the header by ``header_limit(shapes)``, each record by its checked declared lengths, a
zstd frame's content by ``ceil(n_kept / 4)`` (``protocol.envelope.raw_codes``).

- ``read_payload(data, shapes, ...)``: a payload in memory.
- ``read_payload_file(path, shapes, ...)``: the prefix, the header, then only the needed
  records' byte ranges of a file (``os.pread``), never the whole file.
- ``read_payload_ranges(fetch, size, shapes, ...)``: the same over any byte-range source, e.g.
  HTTP Range requests.
- ``payload_base(data, shapes)``: the header's ``base``, from the prefix and header alone;
  ``payload_work`` likewise its steps and tokens.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, Unpack

import numpy as np
import torch

from protocol import kernels
from protocol.envelope import TensorRecord, check_total_size, read_record
from protocol.errors import CodecError, PayloadError
from protocol.indexcode import (
    MAX_LOCAL_TILE_LEN,
    MAX_RICE_BITS,
    check_index,
    decode_flat_index,
    decode_tile_positions,
    flat_index_of,
    max_unary_bytes,
)
from protocol.payload_index import (
    PREFIX,
    Bytes,
    PayloadIndex,
    RecordEntry,
    as_view,
    header_length,
    read_index,
)
from protocol.quantize import codes_canonical, dequant_table, unpack_codes, unpack_stats
from protocol.sparse import Payload, SparseTensor
from protocol.tiles import TileGeometry, check_codec_params

Shapes = Mapping[str, tuple[int, ...]]
#: ``fetch(start, stop)`` returns the payload's bytes ``[start, stop)``.
Fetch = Callable[[int, int], Bytes]
#: A record whose CRC has been checked, its geometry, and the field its errors name.
_Read = tuple[TensorRecord, TileGeometry, str]


class ReadOptions(TypedDict, total=False):
    """The keywords of ``read_payload``, ``read_payload_file`` and ``read_payload_ranges``,
    declared once; each may be left out.

    ``topk``, ``tile``: the run's codec parameters; when given, the payload's tile must be
    the same and its ``topk`` at most the run's (a thin link sends fewer entries per tile).
    ``lazy`` (default False): check every record read now, build each tensor when it is looked
    up. ``only``: the tensors whose records are read (None, the default: every one).
    """

    topk: int | None
    tile: int | None
    lazy: bool
    only: Collection[str] | None


@dataclass(frozen=True)
class _Checked:
    """A record that passed every check, with what the check decoded: its value table and,
    for tiles of at most ``MAX_LOCAL_TILE_LEN`` entries, the in-tile positions (uint16)."""

    record: TensorRecord
    geometry: TileGeometry
    field: str
    table: torch.Tensor
    positions: np.ndarray | None

    def tensor(self) -> SparseTensor:
        """The decoded tensor, without walking the index streams again when the positions
        were kept."""
        if self.positions is None:
            return _decode_record(self.record, self.geometry, self.field)
        g = self.geometry
        codes = unpack_codes(self.record.codes, g.n_kept)
        if codes is None:  # pragma: no cover - the check refused it already
            raise PayloadError(f"{self.field}.codes", "not canonical")
        index = flat_index_of(self.positions, g)
        return SparseTensor(self.record.name, g, index, torch.from_numpy(codes), self.table)


class _LazyTensors(Mapping[str, SparseTensor]):
    """The tensors of an already fully validated payload, built on each lookup (not kept).

    The check walked every index stream once and kept the in-tile positions (2 bytes an
    entry); a lookup turns them into indices and unpacks the codes, with no second walk.
    """

    def __init__(self, records: Mapping[str, _Checked]) -> None:
        self._records = records

    def __getitem__(self, name: str) -> SparseTensor:
        return self._records[name].tensor()

    def record(self, name: str) -> TensorRecord:
        """The validated record of tensor ``name``, its codes raw (for decoders elsewhere, e.g.
        on a GPU)."""
        return self._records[name].record

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)


def header_limit(shapes: Shapes) -> int:
    """Largest header (L) a valid payload for ``shapes`` can have.

    4096 bytes for the fixed fields (three strings of at most 256 characters, 4 bytes each in
    UTF-8, and the numbers), then per tensor 128 bytes for the entry's numbers and statistics,
    4 per character of its name and 16 per dimension: a valid header always fits, and a hostile
    one costs at most this much to read and parse.
    """
    return 4096 + sum(128 + 4 * len(name) + 16 * len(s) for name, s in shapes.items())


def payload_base(data: Bytes, shapes: Shapes) -> str:
    """The header's ``base`` (the fingerprint trained from), read from ``data`` holding at
    least the prefix and the header; the header is checked structurally, no record is read."""
    return read_index(data, max_header=header_limit(shapes)).base


def payload_work(data: Bytes, shapes: Shapes) -> tuple[int, int]:
    """The header's ``(steps, tokens)``: the work the payload carries, read as ``payload_base``."""
    index = read_index(data, max_header=header_limit(shapes))
    return index.steps, index.tokens


# --------------------------------------------------------------------------- header level


def _check_index(
    index: PayloadIndex, shapes: Shapes, topk: int | None, tile: int | None
) -> dict[str, TileGeometry]:
    """Every header-level rule against the model; returns each tensor's geometry."""
    try:
        check_codec_params(index.topk, index.tile)
    except CodecError as exc:
        field = "header.topk" if str(exc).startswith("topk") else "header.tile"
        raise PayloadError(field, str(exc)) from exc
    if topk is not None and index.topk > topk:
        raise PayloadError(
            "header.topk", f"payload uses k={index.topk}, more than the run's {topk}"
        )
    if tile is not None and index.tile != tile:
        raise PayloadError("header.tile", f"payload uses tile={index.tile}, the run uses {tile}")
    names = [e.name for e in index.entries]
    expected = sorted(shapes)
    if names != expected:
        missing = sorted(set(expected) - set(names))
        extra = sorted(set(names) - set(expected))
        detail = (
            f"missing {missing[:3]}, unexpected {extra[:3]}"
            if missing or extra
            else "not in sorted order or repeated"
        )
        raise PayloadError("header.tensors", f"tensor names do not match the model: {detail}")
    geometries = {}
    for e in index.entries:
        shape = tuple(shapes[e.name])
        if e.shape != shape:
            raise PayloadError(
                f"{e.field}.shape", f"{list(e.shape)} differs from the model's {list(shape)}"
            )
        geometries[e.name] = g = TileGeometry.of(shape, topk=index.topk, tile=index.tile)
        _check_lengths(e, g)
    return geometries


def _check_lengths(e: RecordEntry, g: TileGeometry) -> None:
    """The entry's Rice parameter and declared lengths, from the geometry alone."""
    f, n, b = e.field, g.n_kept, e.rice_bits
    if b > MAX_RICE_BITS:
        raise PayloadError(f"{f}.rice_bits", f"must be in [0, {MAX_RICE_BITS}], got {b}")
    codes = (n + 3) // 4
    if e.codes_zstd and e.codes_len >= codes:  # a frame is only ever written to save bytes
        message = f"declares a zstd frame of {e.codes_len} bytes, {n} raw codes take {codes}"
        raise PayloadError(f"{f}.codes", message)
    if not e.codes_zstd and e.codes_len != codes:
        raise PayloadError(f"{f}.codes", f"declares {e.codes_len} bytes, {n} codes take {codes}")
    low, high = (n + 7) // 8, max_unary_bytes(g.n_tiles, g.k, g.tile_len, b)
    if not low <= e.unary_len <= high:
        raise PayloadError(f"{f}.unary", f"declares {e.unary_len} bytes, outside [{low}, {high}]")
    rem = (n * b + 7) // 8
    if e.remainders_len != rem:
        message = f"declares {e.remainders_len} bytes, {n} fields of {b} bits take {rem}"
        raise PayloadError(f"{f}.remainders", message)


# --------------------------------------------------------------------------- record level


def _checked_record(
    rec: TensorRecord, g: TileGeometry, field: str
) -> tuple[TensorRecord, torch.Tensor]:
    """The record with its codes raw, and its value table, after checking its statistics and
    codes (a zstd frame first, then the padding of what it holds)."""
    shift, levels = unpack_stats(rec.stats)
    table = dequant_table(shift, levels)
    if not all(map(math.isfinite, (shift, *levels, *table.tolist()))):
        raise PayloadError(f"{field}.stats", "shift, levels and their sums must be finite")
    size = (g.n_kept + 3) // 4
    rec = rec.raw(size, f"{field}.codes")
    if not codes_canonical(rec.codes, g.n_kept):
        got = len(rec.codes)
        message = f"expected {size} bytes, got {got}" if got != size else "non-zero padding"
        raise PayloadError(f"{field}.codes", message)
    return rec, table


def _check_record(rec: TensorRecord, g: TileGeometry, field: str) -> _Checked:
    """Every check ``_decode_record`` makes, without materialising indices or codes; keeps
    the record with its codes raw (a zstd frame is decompressed once) and the in-tile
    positions the walk decoded (so it is the only walk)."""
    rec, table = _checked_record(rec, g, field)
    args = (rec.rice_bits, rec.unary, rec.remainders)
    if g.tile_len > MAX_LOCAL_TILE_LEN:
        check_index(*args, geometry=g, field=field)
        return _Checked(rec, g, field, table, None)
    positions = decode_tile_positions(*args, geometry=g, field=field)
    return _Checked(rec, g, field, table, positions)


def _decode_record(rec: TensorRecord, g: TileGeometry, field: str) -> SparseTensor:
    rec, table = _checked_record(rec, g, field)
    codes = unpack_codes(rec.codes, g.n_kept)
    if codes is None:  # pragma: no cover - _checked_record refused it already
        raise PayloadError(f"{field}.codes", "not canonical")
    # int32 indices keep G decoded peers small while they wait for aggregation.
    index = decode_flat_index(rec.rice_bits, rec.unary, rec.remainders, geometry=g, field=field)
    return SparseTensor(rec.name, g, index, torch.from_numpy(codes), table)


# --------------------------------------------------------------------------- readers


def _fetch_exact(fetch: Fetch, start: int, stop: int) -> memoryview:
    view = as_view(fetch(start, stop))
    if len(view) != stop - start:
        raise PayloadError("size", f"read {len(view)} bytes at {start}, expected {stop - start}")
    return view


def _selection(only: Collection[str] | None, shapes: Shapes) -> frozenset[str] | None:
    """``only`` as a set of the model's names (``None``: every tensor); a caller's mistake is
    an exception before the payload is looked at."""
    if only is None:
        return None
    if isinstance(only, str):
        raise TypeError("only is a collection of tensor names, not one name")
    chosen = frozenset(only)
    unknown = sorted(chosen - set(shapes))
    if unknown:
        raise KeyError(f"only names tensors the model does not have: {unknown[:3]}")
    return chosen


def _read(
    size: int,
    fetch: Fetch,
    shapes: Shapes,
    read_header: Callable[[], PayloadIndex],
    *,
    topk: int | None = None,
    tile: int | None = None,
    lazy: bool = False,
    only: Collection[str] | None = None,
) -> Payload:
    """What every ``read_payload*`` does once it knows where its bytes are: the caller's
    ``only`` checked, then the index (``read_header``), then the header-level checks against
    every tensor, then the records of ``only`` read and checked (``ReadOptions``)."""
    chosen = _selection(only, shapes)  # a caller's mistake, before the payload is looked at
    index = read_header()
    geometries = _check_index(index, shapes, topk, tile)
    check_total_size(index, size)
    wanted = [e for e in index.entries if chosen is None or e.name in chosen]
    blobs: dict[str, Bytes] = {e.name: b"" for e in wanted}  # an empty record needs no read
    pending = sorted((e for e in wanted if e.size), key=lambda e: e.offset)
    at = 0
    for start, stop in index.ranges(blobs):
        view = _fetch_exact(fetch, start, stop)
        while at < len(pending) and pending[at].offset < stop:  # the records of this range
            e = pending[at]
            blobs[e.name] = view[e.offset - start : e.offset - start + e.size]
            at += 1

    def one(e: RecordEntry) -> _Read:
        return read_record(e, blobs[e.name]), geometries[e.name], e.field

    if lazy:
        checked = kernels.map_threads(lambda e: _check_record(*one(e)), wanted)
        tensors: Mapping[str, SparseTensor] = _LazyTensors({c.record.name: c for c in checked})
    else:
        tensors = {e.name: _decode_record(*one(e)) for e in wanted}
    return Payload(
        index.run_id, index.round, index.node_id, index.base, index.tile, index.topk,
        index.steps, index.tokens, tensors,
    )  # fmt: skip


def read_payload(data: bytes, shapes: Shapes, **options: Unpack[ReadOptions]) -> Payload:
    """Validate the payload ``data`` against the model's ``shapes`` and return it sparse.

    The header is checked against every tensor of the model; the records of the tensors in
    ``only`` (default: all) are checked and decoded, and ``Payload.tensors`` holds exactly
    those (``topk``, ``tile``: ``ReadOptions``). Raises ``PayloadError`` naming the field for
    anything malformed, ``KeyError`` if ``only`` names a tensor the model does not have.

    With ``lazy``, every record read is checked here completely (the index streams are walked
    once, with every rule of the decoder, keeping only each entry's in-tile position as 2
    bytes) and built on lookup in ``tensors`` (indices from those positions, codes unpacked).
    Aggregating G peers tensor by tensor then holds the G payloads' bytes, their positions
    (2 bytes per kept entry, 1/128 of an fp32 model copy per peer at k = 64 of 4096) and one
    built tensor per peer, never G decoded models, and validation still completes before the
    caller applies anything.
    """
    view = as_view(data)

    def fetch(start: int, stop: int) -> memoryview:
        return view[start:stop]  # a view: the records are not copied until they are read

    def read_header() -> PayloadIndex:
        return read_index(view, max_header=header_limit(shapes))

    return _read(len(view), fetch, shapes, read_header, **options)


def read_payload_ranges(
    fetch: Fetch, size: int, shapes: Shapes, **options: Unpack[ReadOptions]
) -> Payload:
    """``read_payload`` on a payload of ``size`` bytes that ``fetch(start, stop)`` reads by
    byte range: the 14-byte prefix, then the header (once its length is checked against the
    model's limit), then one range per run of adjacent records in ``only``
    (``PayloadIndex.ranges``). A short read is a ``PayloadError`` on ``size``; the fetch's own
    errors (I/O, HTTP) propagate unchanged."""

    def read_header() -> PayloadIndex:
        limit = header_limit(shapes)
        prefix = bytes(_fetch_exact(fetch, 0, min(size, PREFIX.size)))
        end = PREFIX.size + header_length(prefix, max_header=limit)
        if size < end:
            raise PayloadError("header", f"truncated: the header ends at byte {end}, got {size}")
        return read_index(prefix + bytes(_fetch_exact(fetch, PREFIX.size, end)), max_header=limit)

    return _read(size, fetch, shapes, read_header, **options)


def read_payload_file(
    path: str | os.PathLike[str], shapes: Shapes, **options: Unpack[ReadOptions]
) -> Payload:
    """``read_payload`` on the payload stored at ``path``, reading only the prefix, the header
    and the records of ``only`` (``os.pread``); the file's size must be the header's total."""
    with Path(path).open("rb") as f:
        fd = f.fileno()

        def fetch(start: int, stop: int) -> bytes:
            parts, at = [], start
            while at < stop:  # pread may return less than asked (very large reads, signals)
                chunk = os.pread(fd, stop - at, at)
                if not chunk:
                    break  # end of file: _fetch_exact reports the short read
                parts.append(chunk)
                at += len(chunk)
            return b"".join(parts)

        return read_payload_ranges(fetch, os.fstat(fd).st_size, shapes, **options)
