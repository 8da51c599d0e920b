"""The payload's index: the fixed prefix and the msgpack header that locate every record.

Format version 3 (``protocol/FORMAT.md`` is the specification; all integers little-endian)::

    offset  size  field
    0       4     magic b"SLCP"
    4       1     format version (3)
    5       1     flags: 0 (reserved)
    6       4     L: header length in bytes (u32)
    10      4     CRC-32 (zlib) of the L header bytes
    14      L     header: msgpack map run, round, node, base, tile, topk, steps, tokens,
                  tensors
    14 + L  ...   the records' data in header order: codes (raw, or one zstd frame of them),
                  unary stream, remainder stream each

The header alone says where every record lies, so a reader that wants a few tensors reads the
prefix, the header and then only their byte ranges (from a file, or by HTTP Range requests).
This module reads the index and checks its *structure*: magic, version, flags, the header's
length against a caller's limit, its checksum, the exact key set, types and sane lengths.
Whether the entries fit the model (names, shapes, declared lengths) is
``protocol.payload_reader``'s job; the records themselves are ``protocol.envelope``'s.

The ``*_field`` helpers are the one place that turns a bad msgpack value into a
``PayloadError`` naming the field; ``protocol.envelope`` uses them for its record lists too.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import msgpack

from protocol.errors import PayloadError

MAGIC = b"SLCP"
VERSION = 3
#: magic, version, flags, header length L, CRC-32 of the header: 14 bytes.
PREFIX = struct.Struct("<4sBBII")
MAX_TEXT = 256  # run id, node id, fingerprint, tensor names (characters)
MAX_DIMS = 8
MAX_ROUND = 2**63 - 1
STATS_SIZE = 20  # shift and four levels, little-endian fp32
#: Structural caps only: the model bounds a dimension, ``b`` and every length far lower, and
#: ``protocol.payload_reader`` checks them against it before anything is allocated or read.
MAX_DIM = 2**40
MAX_RICE = 64
MAX_LENGTH = 2**62
MAX_CRC = 2**32 - 1
#: The inner steps a payload may say it carries, and its tokens (``PayloadHeader.steps``).
MAX_STEPS = 2**32 - 1
MAX_TOKENS = 2**63 - 1
HEADER_KEYS = ("run", "round", "node", "base", "tile", "topk", "steps", "tokens", "tensors")
ENTRY_FIELDS = (
    "name",
    "shape",
    "rice_bits",
    "stats",
    "codes_len",
    "unary_len",
    "remainders_len",
    "crc32",
    "codes_zstd",
)

Bytes = bytes | bytearray | memoryview


@dataclass(frozen=True)
class TensorFields:
    """The codec fields of one tensor, which its record (``TensorRecord``) and its entry in the
    header (``RecordEntry``) both start with."""

    name: str
    shape: tuple[int, ...]
    rice_bits: int
    stats: bytes  # shift and four levels, 20 bytes of fp32


@dataclass(frozen=True)
class RecordEntry(TensorFields):
    """One tensor's entry in the header: its codec fields and where its record lies."""

    codes_len: int
    unary_len: int
    remainders_len: int
    crc32: int  # zlib CRC-32 of the record as stored: codes ‖ unary ‖ remainders
    codes_zstd: bool  # the codes are stored as one zstd frame (else raw); codes_len is stored bytes
    offset: int  # absolute offset of the record's first byte in the payload
    ordinal: int  # its place in the header's ``tensors`` (errors name ``tensors[ordinal]``)

    @property
    def size(self) -> int:
        """The record's length in bytes as stored: codes, unary and remainder streams."""
        return self.codes_len + self.unary_len + self.remainders_len

    @property
    def field(self) -> str:
        """The name errors about this entry or its record start with."""
        return f"tensors[{self.ordinal}]"


@dataclass(frozen=True)
class PayloadHeader:
    """The fields every payload's header carries: who sent it, from which parameters, with which
    codec settings (``Envelope``, ``PayloadIndex`` and the read ``Payload`` all start with them)."""

    run_id: str
    round: int
    node_id: str
    base: str  # fingerprint of the parameters the sender trained from
    tile: int
    topk: int
    #: The work the payload carries: the inner steps its sender trained in the round, and the
    #: tokens those steps read (0: not said, as a codec test or the simulator may leave it).
    steps: int
    tokens: int


@dataclass(frozen=True)
class PayloadIndex(PayloadHeader):
    """A payload's header, structurally valid, with every record's absolute offset."""

    entries: tuple[RecordEntry, ...]
    data_start: int  # 14 + L: where the first record begins
    total_size: int  # what the whole payload must measure exactly

    @cached_property
    def _by_name(self) -> dict[str, RecordEntry]:
        out: dict[str, RecordEntry] = {}
        for e in self.entries:
            out.setdefault(e.name, e)
        return out

    def entry(self, name: str) -> RecordEntry:
        """The entry of tensor ``name``; ``KeyError`` if the header has none."""
        return self._by_name[name]

    def ranges(self, names: Iterable[str]) -> list[tuple[int, int]]:
        """Byte ranges ``[start, stop)`` holding the named records, ascending, adjacent ones
        merged: what a partial reader fetches (one HTTP Range request or ``pread`` each)."""
        spans = sorted((e.offset, e.offset + e.size) for e in map(self.entry, set(names)))
        out: list[tuple[int, int]] = []
        for start, stop in spans:
            if start == stop:
                continue  # an empty record needs no read
            if out and out[-1][1] == start:
                out[-1] = (out[-1][0], stop)
            else:
                out.append((start, stop))
        return out


def as_view(data: Any, field: str = "payload") -> memoryview:
    """``data`` as a flat byte view (never a copy); ``PayloadError`` unless it is bytes-like."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PayloadError(field, f"expected bytes, got {type(data).__name__}")
    return memoryview(data).cast("B")


def header_length(prefix: Bytes, *, max_header: int | None = None) -> int:
    """Check the 14-byte prefix at the start of ``prefix`` (magic, version, flags) and return
    the header length L; with ``max_header``, L must not exceed it (checked before anything of
    that size is read or allocated)."""
    view = as_view(prefix)
    if len(view) < PREFIX.size:
        raise PayloadError("header", f"truncated: {len(view)} bytes, the prefix is {PREFIX.size}")
    magic, version, flags, length, _ = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise PayloadError("header.magic", f"expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise PayloadError("header.version", f"unsupported format version {version}")
    if flags:
        raise PayloadError("header.flags", f"reserved flag bits set: {flags:#04x}")
    if max_header is not None and length > max_header:
        raise PayloadError("header.length", f"{length} bytes exceeds the limit {max_header}")
    return int(length)


def read_index(data: Bytes, *, max_header: int) -> PayloadIndex:
    """Parse and structurally check the prefix and header at the start of ``data`` (which may
    hold more: the records or nothing). ``max_header`` bounds L (see
    ``protocol.payload_reader.header_limit``). Raises ``PayloadError`` naming the field."""
    view = as_view(data)
    length = header_length(view, max_header=max_header)
    end = PREFIX.size + length
    if len(view) < end:
        raise PayloadError("header", f"truncated: the header ends at byte {end}, got {len(view)}")
    header = view[PREFIX.size : end]
    if zlib.crc32(header) != PREFIX.unpack_from(view)[4]:
        raise PayloadError("header.crc32", "header checksum mismatch (corrupted)")
    try:
        obj = msgpack.unpackb(header, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise PayloadError("header", f"not one valid msgpack document: {exc}") from exc
    return _parse_header(obj, end)


# --------------------------------------------------------------------------- field checks


def check(cond: bool, field: str, message: str) -> None:
    """``PayloadError(field, message)`` unless ``cond``."""
    if not cond:
        raise PayloadError(field, message)


def text_field(value: Any, field: str) -> str:
    """A str of at most ``MAX_TEXT`` characters."""
    check(isinstance(value, str), field, f"expected a string, got {type(value).__name__}")
    check(len(value) <= MAX_TEXT, field, f"longer than {MAX_TEXT} characters")
    return value  # type: ignore[no-any-return,unused-ignore]


def uint_field(value: Any, field: str, upper: int) -> int:
    """An int (not a bool) in ``[0, upper]``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= upper
    check(ok, field, f"expected an integer in [0, {upper}], got {value!r}")
    return value  # type: ignore[no-any-return,unused-ignore]


def bin_field(value: Any, field: str, size: int | None = None) -> bytes:
    """A msgpack bin (bytes), of exactly ``size`` bytes when given."""
    check(isinstance(value, bytes), field, f"expected bytes, got {type(value).__name__}")
    if size is not None:
        check(len(value) == size, field, f"expected {size} bytes, got {len(value)}")
    return value  # type: ignore[no-any-return,unused-ignore]


def shape_field(value: Any, field: str) -> tuple[int, ...]:
    """A list of at most ``MAX_DIMS`` dimensions, each an int in ``[0, MAX_DIM]``."""
    ok = isinstance(value, list) and len(value) <= MAX_DIMS
    check(ok, field, f"expected a list of at most {MAX_DIMS} dimensions")
    return tuple(uint_field(d, field, MAX_DIM) for d in value)


def _parse_header(obj: Any, data_start: int) -> PayloadIndex:
    check(isinstance(obj, dict), "header", "expected a map")
    keys = set(obj)
    want = set(HEADER_KEYS)
    check(keys == want, "header", f"fields {sorted(map(str, keys))}, expected {sorted(want)}")
    tensors = obj["tensors"]
    check(isinstance(tensors, list), "header.tensors", "expected a list")
    entries = []
    offset = data_start
    for i, row in enumerate(tensors):
        f = f"tensors[{i}]"
        ok = isinstance(row, list) and len(row) == len(ENTRY_FIELDS)
        check(ok, f, f"expected a list of {len(ENTRY_FIELDS)} fields")
        entry = RecordEntry(
            name=text_field(row[0], f"{f}.name"),
            shape=shape_field(row[1], f"{f}.shape"),
            rice_bits=uint_field(row[2], f"{f}.rice_bits", MAX_RICE),
            stats=bin_field(row[3], f"{f}.stats", STATS_SIZE),
            codes_len=uint_field(row[4], f"{f}.codes", MAX_LENGTH),
            unary_len=uint_field(row[5], f"{f}.unary", MAX_LENGTH),
            remainders_len=uint_field(row[6], f"{f}.remainders", MAX_LENGTH),
            crc32=uint_field(row[7], f"{f}.crc32", MAX_CRC),
            codes_zstd=bool(uint_field(row[8], f"{f}.codes_zstd", 1)),
            offset=offset,
            ordinal=i,
        )
        entries.append(entry)
        offset += entry.size
    return PayloadIndex(
        run_id=text_field(obj["run"], "header.run"),
        round=uint_field(obj["round"], "header.round", MAX_ROUND),
        node_id=text_field(obj["node"], "header.node"),
        base=text_field(obj["base"], "header.base"),
        tile=uint_field(obj["tile"], "header.tile", 2**31),
        topk=uint_field(obj["topk"], "header.topk", 2**62),
        steps=uint_field(obj["steps"], "header.steps", MAX_STEPS),
        tokens=uint_field(obj["tokens"], "header.tokens", MAX_TOKENS),
        entries=tuple(entries),
        data_start=data_start,
        total_size=offset,
    )
