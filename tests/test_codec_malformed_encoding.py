"""Malformed payloads in the body's encodings: odd msgpack documents and extension types,
trailing bytes, zstd frames that lie or explode, and enormous shape or stream claims, which must
be refused in bounded time and memory.

Every one must raise PayloadError naming the field, and nothing else.
"""

from __future__ import annotations

import copy
import struct
import time
import tracemalloc
from typing import Any

import msgpack
import pytest
import zstandard

from protocol.envelope import wrap_body
from support import reference_codec as ref
from support.malformed_fixtures import BODY, reject, rewrap

# ---- msgpack documents ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"\x91" * 5000 + b"\xc0",  # nesting far deeper than any valid body
        b"\x81\xa3run\xa2\xff\xfe",  # invalid UTF-8 in a string
        b"\x81\xa2\xff\xfe\xc0",  # invalid UTF-8 in a key
        b"\x81\xca\x00\x00\x00\x00\xc0",  # a float key
        b"\x81\x01\xc0",  # an int key
        b"\x81\xc0\xc0",  # a nil key
        b"\x81\xa3run\xc7\x03\xff\x00\x00\x00",  # a malformed timestamp extension
        b"\xdd\xff\xff\xff\xff",  # an array header claiming 2**32 - 1 items
        b"\xc6\xff\xff\xff\xff",  # a bin header claiming 4 GiB
        b"\xdf\xff\xff\xff\xff",  # a map header claiming 2**32 - 1 pairs
        b"\xc1",  # the never-used type byte
    ],
)
def test_odd_msgpack_documents(raw: bytes) -> None:
    assert reject(wrap_body(raw, 0)).field == "body"


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("tensors", 0, 3), msgpack.ExtType(5, b"\x00" * 20), "tensors[0].stats"),
        (("round",), msgpack.Timestamp(1, 0), "body.round"),
        (("run",), msgpack.ExtType(1, b"run"), "body.run"),
        (("tensors", 0, 1, 0), msgpack.ExtType(0, b"\x08"), "tensors[0].shape"),
    ],
)
def test_extension_types_are_rejected(path: tuple, value: Any, field: str) -> None:
    body = copy.deepcopy(BODY)
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert reject(rewrap(body)).field == field


# ---- trailing bytes and zstd ----------------------------------------------------------------


def test_trailing_bytes_after_the_msgpack_body() -> None:
    raw = msgpack.packb(BODY, use_bin_type=True)
    for tail in (b"\x00", b"\xc0", raw):
        assert reject(wrap_body(raw + tail, 0)).field == "body"


def test_trailing_bytes_after_the_msgpack_body_inside_zstd() -> None:
    raw = msgpack.packb(BODY, use_bin_type=True) + b"\x00"
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    assert reject(wrap_body(frame, 1)).field == "body"


def _frame(raw: bytes, **kwargs: Any) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=True, **kwargs).compress(raw)


def _lying_frame(declared: int, window: int = 0x00) -> bytes:
    """A zstd frame header declaring ``declared`` bytes (8-byte content size field, window
    descriptor ``window``: 0x00 is 1 KiB), then one tiny raw block."""
    fhd = 0b1100_0000  # FCS field 8 bytes, no single segment, no checksum, no dictionary
    header = b"\x28\xb5\x2f\xfd" + bytes([fhd, window]) + struct.pack("<Q", declared)
    block = (1 | (0 << 1) | (3 << 3)).to_bytes(3, "little") + b"abc"  # last, raw, 3 bytes
    return header + block


ZSTD_CASES: list[tuple[str, bytes]] = [
    ("trailing-byte", _frame(msgpack.packb(BODY, use_bin_type=True)) + b"\x00"),
    ("two-frames", _frame(msgpack.packb(BODY, use_bin_type=True)) * 2),
    ("trailing-skippable", _frame(msgpack.packb(BODY)) + struct.pack("<II", 0x184D2A50, 0)),
    ("garbage", b"\x28\xb5\x2f\xfd" + b"\x07garbage" * 4),
    ("not-zstd", msgpack.packb(BODY, use_bin_type=True)),
    ("empty", b""),
    ("magic-only", b"\x28\xb5\x2f\xfd"),
    ("truncated", _frame(msgpack.packb(BODY, use_bin_type=True))[:-2]),
    ("no-content-size", zstandard.ZstdCompressor(write_content_size=False).compress(b"x" * 99)),
    ("declares-1e12", _lying_frame(10**12)),
    ("declares-2^64-2", _lying_frame(2**64 - 2)),
    ("declares-more-than-it-holds", _lying_frame(1000)),
    ("declares-less-than-it-holds", _lying_frame(1)),
    ("bomb-10MB-of-zeros", _frame(b"\x00" * 10_000_000)),
    ("window-2^41", _lying_frame(1000, window=0xF8)),
    ("window-2^27", _lying_frame(1000, window=0x88)),
    ("skippable-only", struct.pack("<II", 0x184D2A50, 4) + b"abcd"),
]


@pytest.mark.parametrize("frame", [c[1] for c in ZSTD_CASES], ids=[c[0] for c in ZSTD_CASES])
def test_bad_zstd_bodies(frame: bytes) -> None:
    err = reject(wrap_body(frame, 1))
    assert err.field.startswith("body")


@pytest.mark.parametrize(
    "content", [b"", b"\xc1", b"\x91\x00", msgpack.packb([BODY]), b"\x00" * 100]
)
def test_zstd_frames_holding_a_bad_document(content: bytes) -> None:
    assert reject(wrap_body(_frame(content), 1)).field == "body"


def test_zstd_body_over_the_model_limit_is_refused_before_decompressing() -> None:
    frame = _frame(b"\x00" * 10_000_000)
    assert len(frame) < 2000
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        err = reject(wrap_body(frame, 1))
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.field == "body.zstd"
    assert peak < 1_000_000 and elapsed < 1.0


# ---- bounded work on enormous claims --------------------------------------------------------


def _claim(shape: list[int], **overrides: Any) -> bytes:
    body = {
        "run": "",
        "round": 0,
        "node": "",
        "base": "",
        "tile": 64,
        "topk": 64,
        "tensors": [["w", shape, 0, ref.stats_bytes(0.0, (0.0,) * 4), b"", b"", b""]],
    }
    body.update(overrides)
    return rewrap(body)


@pytest.mark.parametrize(
    ("model", "claim"),
    [
        ({"w": (64, 64)}, [10**6, 10**6]),  # claims 1e12 elements, the model has 4096
        ({"w": (10**6, 10**6)}, [10**6, 10**6]),  # the model itself is huge: streams too short
        ({"w": (2**40,)}, [2**40]),
        ({"w": (2**20, 2**20)}, [2**20, 2**20]),
    ],
    ids=["small-model", "huge-model", "huge-1d", "huge-square"],
)
def test_enormous_claims_are_rejected_without_allocating(model: dict, claim: list[int]) -> None:
    data = _claim(claim)
    assert len(data) < 120
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        reject(data, model)
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert elapsed < 1.0


def test_huge_declared_stream_lengths_are_bounded_by_the_model() -> None:
    """Streams far longer than the model could need are refused by the body limit (one byte
    per parameter plus overhead), even behind a valid CRC."""
    body = copy.deepcopy(BODY)
    body["tensors"][0][5] = b"\x00" * 200_000
    assert reject(rewrap(body)).field == "body"
    assert reject(rewrap(body, zstd=True)).field == "body.zstd"
