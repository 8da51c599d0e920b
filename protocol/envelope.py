"""The payload envelope: a fixed binary header, then a msgpack body, optionally zstd-compressed.

Byte layout (all integers little-endian; ``protocol/FORMAT.md`` is the full specification)::

    offset  size  field
    0       4     magic  b"SLCP"
    4       1     format version (1)
    5       1     flags: bit 0 = body is one zstd frame; other bits must be 0
    6       4     CRC-32 (zlib polynomial) of the body bytes as stored
    10      ...   body

This module checks the *structure* only: magic, version, flags, checksum, body size against a
caller-supplied limit, and that the msgpack body has exactly the fields of version 1 with the
right types and sane lengths. Whether the tensors fit the model is ``protocol.codec``'s job.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import zstandard

from protocol.errors import PayloadError

MAGIC = b"SLCP"
VERSION = 1
FLAG_ZSTD = 0x01
HEADER = struct.Struct("<4sBBI")
MAX_TEXT = 256  # run id, node id, fingerprint, tensor names
MAX_DIMS = 8
MAX_ROUND = 2**63 - 1
_BODY_KEYS = frozenset({"run", "round", "node", "base", "tile", "topk", "tensors"})
_RECORD_FIELDS = 7


@dataclass(frozen=True)
class TensorRecord:
    """One tensor's section of the body, still encoded."""

    name: str
    shape: tuple[int, ...]
    rice_bits: int
    stats: bytes  # shift and four levels, 20 bytes of fp32
    codes: bytes
    unary: bytes
    remainders: bytes


@dataclass(frozen=True)
class Envelope:
    """A whole payload: who sent it, from which parameters, with which codec settings."""

    run_id: str
    round: int
    node_id: str
    base: str  # fingerprint of the parameters the sender trained from
    tile: int
    topk: int
    tensors: tuple[TensorRecord, ...]


def pack_envelope(env: Envelope, *, compress: bool | None = None) -> bytes:
    """Serialise ``env``. ``compress=None`` uses zstd only when it makes the payload smaller."""
    body = msgpack.packb(
        {
            "run": env.run_id,
            "round": env.round,
            "node": env.node_id,
            "base": env.base,
            "tile": env.tile,
            "topk": env.topk,
            "tensors": [
                [t.name, list(t.shape), t.rice_bits, t.stats, t.codes, t.unary, t.remainders]
                for t in env.tensors
            ],
        },
        use_bin_type=True,
    )
    flags = 0
    if compress is not False:
        packed = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(body)
        if compress or len(packed) < len(body):
            body, flags = packed, FLAG_ZSTD
    return wrap_body(body, flags)


def wrap_body(body: bytes, flags: int, *, version: int = VERSION) -> bytes:
    """Prefix ``body`` (as stored) with the header. Exposed for building test corpora."""
    return HEADER.pack(MAGIC, version, flags, zlib.crc32(body)) + body


def unpack_envelope(data: bytes | bytearray | memoryview, *, max_body: int) -> Envelope:
    """Parse and structurally validate a payload; the decompressed body may not exceed
    ``max_body`` bytes. Raises ``PayloadError`` naming the offending field."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PayloadError("payload", f"expected bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")  # slices below share the caller's bytes, never copy
    if len(view) < HEADER.size:
        raise PayloadError("header", f"truncated: {len(view)} bytes, header is {HEADER.size}")
    magic, version, flags, crc = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise PayloadError("header.magic", f"expected {MAGIC!r}, got {magic!r}")
    if version != VERSION:
        raise PayloadError("header.version", f"unsupported format version {version}")
    if flags & ~FLAG_ZSTD:
        raise PayloadError("header.flags", f"unknown flag bits {flags:#04x}")
    body = view[HEADER.size :]
    if zlib.crc32(body) != crc:
        raise PayloadError("header.crc32", "body checksum mismatch (corrupted or truncated)")
    if flags & FLAG_ZSTD:
        body = memoryview(_decompress(body, max_body))
    elif len(body) > max_body:
        raise PayloadError("body", f"{len(body)} bytes exceeds the limit {max_body}")
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise PayloadError("body", f"not a valid msgpack document: {exc}") from exc
    return _parse_body(obj)


def _decompress(body: memoryview, max_body: int) -> bytes:
    try:
        size = zstandard.get_frame_parameters(body).content_size
    except zstandard.ZstdError as exc:
        raise PayloadError("body.zstd", f"bad frame header: {exc}") from exc
    if size == zstandard.CONTENTSIZE_UNKNOWN or size > max_body:
        raise PayloadError("body.zstd", f"declared size {size} missing or over limit {max_body}")
    try:
        # One pass: the output buffer is the declared size, and zstd fails if the frame would
        # produce more or less than that, or if anything follows the frame.
        out = zstandard.ZstdDecompressor().decompress(body, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise PayloadError("body.zstd", f"corrupt frame or trailing bytes: {exc}") from exc
    if len(out) != size:
        raise PayloadError("body.zstd", "frame size mismatch or trailing bytes after the frame")
    return out


def _expect(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise PayloadError(field, message)


def _text(value: Any, field: str) -> str:
    _expect(isinstance(value, str), field, f"expected a string, got {type(value).__name__}")
    _expect(len(value) <= MAX_TEXT, field, f"longer than {MAX_TEXT} characters")
    return value  # type: ignore[no-any-return,unused-ignore]


def _uint(value: Any, field: str, upper: int) -> int:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= upper
    _expect(ok, field, f"expected an integer in [0, {upper}], got {value!r}")
    return value  # type: ignore[no-any-return,unused-ignore]


def _bin(value: Any, field: str) -> bytes:
    _expect(isinstance(value, bytes), field, f"expected bytes, got {type(value).__name__}")
    return value  # type: ignore[no-any-return,unused-ignore]


def _parse_body(obj: Any) -> Envelope:
    _expect(isinstance(obj, dict), "body", "expected a map")
    keys = set(obj)
    _expect(
        keys == _BODY_KEYS,
        "body",
        f"fields {sorted(map(str, keys))}, expected {sorted(_BODY_KEYS)}",
    )
    tensors = obj["tensors"]
    _expect(isinstance(tensors, list), "body.tensors", "expected a list")
    records = []
    for i, rec in enumerate(tensors):
        f = f"tensors[{i}]"
        _expect(
            isinstance(rec, list) and len(rec) == _RECORD_FIELDS,
            f,
            f"expected a list of {_RECORD_FIELDS} fields",
        )
        shape = rec[1]
        _expect(
            isinstance(shape, list) and len(shape) <= MAX_DIMS,
            f"{f}.shape",
            f"expected a list of at most {MAX_DIMS} dimensions",
        )
        records.append(
            TensorRecord(
                name=_text(rec[0], f"{f}.name"),
                shape=tuple(_uint(d, f"{f}.shape", 2**40) for d in shape),
                rice_bits=_uint(rec[2], f"{f}.rice_bits", 64),
                stats=_bin(rec[3], f"{f}.stats"),
                codes=_bin(rec[4], f"{f}.codes"),
                unary=_bin(rec[5], f"{f}.unary"),
                remainders=_bin(rec[6], f"{f}.remainders"),
            )
        )
    return Envelope(
        run_id=_text(obj["run"], "body.run"),
        round=_uint(obj["round"], "body.round", MAX_ROUND),
        node_id=_text(obj["node"], "body.node"),
        base=_text(obj["base"], "body.base"),
        tile=_uint(obj["tile"], "body.tile", 2**31),
        topk=_uint(obj["topk"], "body.topk", 2**62),
        tensors=tuple(records),
    )
