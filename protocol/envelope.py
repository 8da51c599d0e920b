"""The payload as bytes (format version 3): writing it whole, and reading its records.

A payload is a 14-byte prefix, a msgpack header that indexes every tensor's record, then the
records back to back (``protocol/FORMAT.md`` is the specification; ``protocol.payload_index``
reads the prefix and the header). Each record is the tensor's packed codes, its unary stream
and its remainder stream, covered by a CRC-32 in its header entry, so a reader can fetch and
check any subset of the records by byte range without the rest. The codes are stored raw or,
where that is shorter, as one zstd frame of the raw bytes (the 2-bit codes are skewed towards
the middle codes, which zstd's entropy coder turns into about a fifth fewer bytes).

- ``TensorRecord.of(...)`` makes a record of raw packed codes, stored as writers store them
  (``store_codes``: zstd where it is shorter); ``TensorRecord.raw(...)`` is the same record
  with raw codes again, the frame checked against the size the model gives (``raw_codes``);
- ``pack_envelope(env)`` writes a whole payload;
- ``read_record(entry, blob)`` checks one record's bytes against its entry (length, CRC);
- ``unpack_envelope(data, max_header=...)`` reads a whole payload: the index, every record, and
  the exact total size;
- ``records_to_bytes`` / ``records_from_bytes`` carry encoded records between the processes of
  one node (each rank encodes its own tensors; rank 0 assembles the payload). That is not the
  payload format and nothing of it crosses the network.

This module checks *structure* only. Whether the entries fit the model, and the records' inner
rules (finite statistics, canonical codes, index streams), are ``protocol.payload_reader``'s; a
record read here keeps its codes as stored, since only the model says how many bytes a zstd
frame of codes may produce (``raw_codes`` is called with that size, never with the frame's).
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zstandard

from protocol.errors import CodecError, PayloadError
from protocol.payload_index import (
    MAGIC,
    MAX_DIMS,
    MAX_RICE,
    MAX_ROUND,
    MAX_STEPS,
    MAX_TEXT,
    MAX_TOKENS,
    PREFIX,
    STATS_SIZE,
    VERSION,
    Bytes,
    PayloadHeader,
    PayloadIndex,
    RecordEntry,
    TensorFields,
    as_view,
    bin_field,
    check,
    header_length,
    read_index,
    shape_field,
    text_field,
    uint_field,
)

__all__ = [
    "MAGIC",
    "MAX_DIMS",
    "MAX_ROUND",
    "MAX_STEPS",
    "MAX_TEXT",
    "MAX_TOKENS",
    "PREFIX",
    "VERSION",
    "Envelope",
    "PayloadIndex",
    "RecordEntry",
    "TensorRecord",
    "check_total_size",
    "header_length",
    "pack_envelope",
    "raw_codes",
    "read_index",
    "read_record",
    "record_crc",
    "records_from_bytes",
    "records_to_bytes",
    "store_codes",
    "unpack_envelope",
]

_MAX_HEADER_BYTES = 2**32 - 1  # L is a u32
#: zstd's level for the codes. Level 1 gave the smallest frames of the levels measured (1, 3, 6,
#: 9, 19) on error-feedback-like buffers (the codes are near-random bytes: the entropy coder
#: does the work, longer match searches only add sequences) and is the fastest. Fixed, so the
#: same codes give the same frame on every machine with the same zstandard release.
ZSTD_LEVEL = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # a zstd frame (RFC 8878), not a skippable frame


@dataclass(frozen=True)
class TensorRecord(TensorFields):
    """One tensor, encoded: its header fields and the three sections of its record.

    ``codes`` are as stored: the packed 2-bit codes, or with ``codes_zstd`` one zstd frame of
    them. Encoders build records with ``of``; readers turn the frame back into raw codes with
    ``raw`` once the model has said how many bytes the codes are.
    """

    codes: bytes
    unary: bytes
    remainders: bytes
    codes_zstd: bool = False

    @classmethod
    def of(
        cls,
        name: str,
        shape: tuple[int, ...],
        rice_bits: int,
        stats: bytes,
        packed_codes: bytes,
        unary: bytes,
        remainders: bytes,
    ) -> TensorRecord:
        """The record of raw ``packed_codes``, stored as writers store them (``store_codes``)."""
        codes, zstd = store_codes(packed_codes)
        return cls(name, shape, rice_bits, stats, codes, unary, remainders, zstd)

    def raw(self, codes_size: int, field: str) -> TensorRecord:
        """This record with raw codes: itself, or its zstd frame decompressed by ``raw_codes``
        to exactly ``codes_size`` bytes (``ceil(n_kept / 4)`` of the model's geometry)."""
        if not self.codes_zstd:
            return self
        codes = raw_codes(self.codes, codes_size, field)
        return TensorRecord(
            self.name, self.shape, self.rice_bits, self.stats, codes, self.unary, self.remainders
        )


@dataclass(frozen=True)
class Envelope(PayloadHeader):
    """A whole payload: its header fields and every tensor's record."""

    tensors: tuple[TensorRecord, ...]


def record_crc(rec: TensorRecord) -> int:
    """The CRC-32 of a record's data as stored: codes ‖ unary ‖ remainders."""
    return zlib.crc32(rec.remainders, zlib.crc32(rec.unary, zlib.crc32(rec.codes)))


# --------------------------------------------------------------------------- codes as stored


def store_codes(packed: bytes) -> tuple[bytes, bool]:
    """``(stored, is_zstd)``: one zstd frame of the ``packed`` codes when that is shorter,
    else ``packed`` itself (ties stay raw: a frame must save at least a byte)."""
    frame = zstandard.ZstdCompressor(
        level=ZSTD_LEVEL, write_content_size=True, write_checksum=False, write_dict_id=False
    ).compress(packed)
    return (frame, True) if len(frame) < len(packed) else (packed, False)


def raw_codes(frame: Bytes, size: int, field: str) -> bytes:
    """The packed codes inside ``frame``, which must be exactly ``size`` bytes of content.

    ``size`` comes from the model (``ceil(n_kept / 4)``), never from the frame: the frame must
    be one zstd frame (not a skippable one) declaring its content size, that size must be
    ``size``, it needs no dictionary and its window is no larger than its content, all checked
    from the frame header before anything is decompressed; then it is decompressed in one shot
    into exactly ``size`` bytes, and nothing may follow it. So memory stays bounded by the
    model whatever the frame claims. ``PayloadError(field)`` for any violation.
    """
    view = as_view(frame, field)
    check(bytes(view[:4]) == ZSTD_MAGIC, field, "not a zstd frame")
    try:
        params = zstandard.get_frame_parameters(view)
    except zstandard.ZstdError as exc:
        raise PayloadError(field, f"bad zstd frame header: {exc}") from exc
    declared = params.content_size
    check(declared != zstandard.CONTENTSIZE_UNKNOWN, field, "the frame has no content size")
    check(declared == size, field, f"the frame declares {declared} bytes, the codes are {size}")
    check(params.dict_id == 0, field, "the frame needs a dictionary")
    window = params.window_size
    check(window <= size, field, f"the frame's window ({window} bytes) exceeds its content")
    try:
        out = zstandard.ZstdDecompressor().decompress(view, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise PayloadError(field, f"corrupt zstd frame, or bytes after it: {exc}") from exc
    check(len(out) == size, field, f"the frame holds {len(out)} bytes, it declares {size}")
    return out


# --------------------------------------------------------------------------- the payload


def pack_envelope(env: Envelope) -> bytes:
    """Serialise ``env`` (records in ascending name order, each name once).

    Raises ``CodecError`` for records out of order or repeated, or statistics that are not 20
    bytes: a reader would reject the payload, so it is never written.
    """
    names = [t.name for t in env.tensors]
    if any(a >= b for a, b in itertools.pairwise(names)):
        raise CodecError("records must be in ascending name order, each name once")
    rows = []
    for t in env.tensors:
        if len(t.stats) != STATS_SIZE:
            raise CodecError(f"tensor {t.name!r}: statistics must be {STATS_SIZE} bytes")
        lengths = (len(t.codes), len(t.unary), len(t.remainders))
        row = [t.name, list(t.shape), t.rice_bits, bytes(t.stats), *lengths, record_crc(t)]
        rows.append([*row, int(t.codes_zstd)])
    header = msgpack.packb(
        {
            "run": env.run_id,
            "round": env.round,
            "node": env.node_id,
            "base": env.base,
            "tile": env.tile,
            "topk": env.topk,
            "steps": env.steps,
            "tokens": env.tokens,
            "tensors": rows,
        },
        use_bin_type=True,
    )
    if len(header) > _MAX_HEADER_BYTES:
        raise CodecError(f"the header is {len(header)} bytes; the format allows 2**32 - 1")
    parts = [PREFIX.pack(MAGIC, VERSION, 0, len(header), zlib.crc32(header)), header]
    for t in env.tensors:
        parts += (t.codes, t.unary, t.remainders)
    return b"".join(parts)


def read_record(entry: RecordEntry, blob: Bytes) -> TensorRecord:
    """The record of ``entry`` from ``blob``, exactly its ``entry.size`` bytes (the payload's
    ``[entry.offset, entry.offset + entry.size)``), after checking the length and the CRC. The
    codes stay as stored (``TensorRecord.raw`` decompresses a frame)."""
    view = as_view(blob, entry.field)
    check(len(view) == entry.size, entry.field, f"expected {entry.size} bytes, got {len(view)}")
    check(zlib.crc32(view) == entry.crc32, f"{entry.field}.crc32", "record checksum mismatch")
    a = entry.codes_len
    b = a + entry.unary_len
    return TensorRecord(
        entry.name,
        entry.shape,
        entry.rice_bits,
        entry.stats,
        bytes(view[:a]),
        bytes(view[a:b]),
        bytes(view[b:]),
        entry.codes_zstd,
    )


def check_total_size(index: PayloadIndex, size: int) -> None:
    """``PayloadError("size")`` unless a payload of ``size`` bytes is exactly what ``index``
    describes: no truncated record, nothing after the last one."""
    if size != index.total_size:
        raise PayloadError("size", f"{size} bytes, the header describes exactly {index.total_size}")


def unpack_envelope(data: Bytes, *, max_header: int) -> Envelope:
    """Parse a whole payload and check its structure: the prefix and header (L at most
    ``max_header`` bytes), the exact total size and every record's CRC. Raises
    ``PayloadError`` naming the offending field."""
    index = read_index(data, max_header=max_header)
    view = as_view(data)
    check_total_size(index, len(view))
    records = tuple(read_record(e, view[e.offset : e.offset + e.size]) for e in index.entries)
    return Envelope(
        index.run_id, index.round, index.node_id, index.base, index.tile, index.topk,
        index.steps, index.tokens, records,
    )  # fmt: skip


# --------------------------------------------------------------------------- within a node


def records_to_bytes(records: Sequence[TensorRecord]) -> bytes:
    """Encoded records as one msgpack array (8 fields each, the codes as stored), for rank 0
    of the same node."""
    return msgpack.packb(
        [
            [
                *(r.name, list(r.shape), r.rice_bits, bytes(r.stats)),
                *(r.codes, r.unary, r.remainders, int(r.codes_zstd)),
            ]
            for r in records
        ],
        use_bin_type=True,
    )


def records_from_bytes(data: Bytes) -> list[TensorRecord]:
    """Inverse of ``records_to_bytes``. The input comes from the same node, but a bug or a torn
    message must still end in a ``PayloadError`` naming the field, never in a bad payload."""
    view = as_view(data, "records")
    try:
        obj: Any = msgpack.unpackb(view, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise PayloadError("records", f"not one valid msgpack document: {exc}") from exc
    check(isinstance(obj, list), "records", "expected a list")
    out = []
    for i, row in enumerate(obj):
        f = f"records[{i}]"
        check(isinstance(row, list) and len(row) == 8, f, "expected a list of 8 fields")
        out.append(
            TensorRecord(
                name=text_field(row[0], f"{f}.name"),
                shape=shape_field(row[1], f"{f}.shape"),
                rice_bits=uint_field(row[2], f"{f}.rice_bits", MAX_RICE),
                stats=bin_field(row[3], f"{f}.stats", STATS_SIZE),
                codes=bin_field(row[4], f"{f}.codes"),
                unary=bin_field(row[5], f"{f}.unary"),
                remainders=bin_field(row[6], f"{f}.remainders"),
                codes_zstd=bool(uint_field(row[7], f"{f}.codes_zstd", 1)),
            )
        )
    return out
