"""Malformed payloads in the header's encoding: odd msgpack documents and extension types,
trailing bytes inside the header and after the last record, payloads of other format versions
(version 1's zstd bodies included), and enormous length, shape or decompressed-size claims
(zstd frames of codes that would inflate far past the codes' size), which must be refused in
bounded time and memory before anything of that size is read or decompressed.

Every one must raise PayloadError naming the field, and nothing else.
"""

from __future__ import annotations

import copy
import struct
import time
import tracemalloc
import zlib
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zstandard

from support import reference_codec as ref
from support.malformed_fixtures import HEADER, RECORDS, SMALL, reject, with_sections

_RAW = msgpack.packb(HEADER, use_bin_type=True)
_DATA = b"".join(b"".join(r) for r in RECORDS)

# ---- msgpack documents ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"\x91" * 4000 + b"\xc0",  # nesting far deeper than any valid header (within L)
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
        b"",  # no document at all
    ],
)
def test_odd_msgpack_documents(raw: bytes) -> None:
    assert reject(ref.wrap_header(raw, _DATA)).field == "header"


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("tensors", 0, 3), msgpack.ExtType(5, b"\x00" * 20), "tensors[0].stats"),
        (("tensors", 0, 4), msgpack.ExtType(5, b"\x06"), "tensors[0].codes"),
        (("tensors", 0, 7), msgpack.Timestamp(1, 0), "tensors[0].crc32"),
        (("round",), msgpack.Timestamp(1, 0), "header.round"),
        (("run",), msgpack.ExtType(1, b"run"), "header.run"),
        (("tensors", 0, 1, 0), msgpack.ExtType(0, b"\x08"), "tensors[0].shape"),
    ],
)
def test_extension_types_are_rejected(path: tuple, value: Any, field: str) -> None:
    header = copy.deepcopy(HEADER)
    node = header
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert reject(ref.build_payload(header, RECORDS, sync=False)).field == field


# ---- trailing bytes, other versions ---------------------------------------------------------


def test_trailing_bytes_inside_the_header() -> None:
    for tail in (b"\x00", b"\xc0", _RAW):
        assert reject(ref.wrap_header(_RAW + tail, _DATA)).field == "header"


def test_trailing_bytes_after_the_last_record() -> None:
    for tail in (b"\x00", b"\xc0", _DATA, SMALL):
        assert reject(SMALL + tail).field == "size"


def _v1_payload(body: bytes, flags: int) -> bytes:
    return struct.pack("<4sBBI", b"SLCP", 1, flags, zlib.crc32(body)) + body


V1_CASES: list[tuple[str, bytes]] = [
    ("v1-plain", _v1_payload(_RAW, 0)),
    ("v1-zstd", _v1_payload(zstandard.ZstdCompressor(write_content_size=True).compress(_RAW), 1)),
    ("v1-bomb", _v1_payload(zstandard.ZstdCompressor().compress(b"\x00" * 10_000_000), 1)),
]


@pytest.mark.parametrize("data", [c[1] for c in V1_CASES], ids=[c[0] for c in V1_CASES])
def test_version_1_payloads_are_refused_unread(data: bytes) -> None:
    tracemalloc.start()
    try:
        err = reject(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.field == "header.version"
    assert peak < 1_000_000


def test_a_zstd_frame_as_the_header_is_not_a_header() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(_RAW)
    assert reject(ref.wrap_header(frame, _DATA)).field == "header"


# ---- bounded work on enormous claims --------------------------------------------------------


def _claim(
    shape: list[int], lengths: tuple[int, int, int] = (0, 0, 0), codes_zstd: int = 0
) -> bytes:
    header = {
        "run": "",
        "round": 0,
        "node": "",
        "base": "",
        "tile": 64,
        "topk": 64,
        "steps": 0,
        "tokens": 0,
        "tensors": [["w", shape, 0, ref.stats_bytes(0.0, (0.0,) * 4), *lengths, 0, codes_zstd]],
    }
    return ref.build_payload(header, sync=False)


def _bounded(fn: Callable[[], Any]) -> Any:
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak
    assert elapsed < 1.0
    return out


@pytest.mark.parametrize(
    ("model", "claim"),
    [
        ({"w": (64, 64)}, [10**6, 10**6]),  # claims 1e12 elements, the model has 4096
        ({"w": (10**6, 10**6)}, [10**6, 10**6]),  # the model itself is huge: lengths too short
        ({"w": (2**40,)}, [2**40]),
        ({"w": (2**20, 2**20)}, [2**20, 2**20]),
    ],
    ids=["small-model", "huge-model", "huge-1d", "huge-square"],
)
def test_enormous_claims_are_rejected_without_allocating(model: dict, claim: list[int]) -> None:
    data = _claim(claim)
    assert len(data) < 120
    _bounded(lambda: reject(data, model))


@pytest.mark.parametrize("codes_zstd", [0, 1])
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("length", [2**40, 2**62])
def test_enormous_declared_lengths_are_rejected_from_the_header(
    which: int, length: int, codes_zstd: int
) -> None:
    """A header declaring records of terabytes, over a payload of a few bytes: the model's
    length rules refuse it before the size is even compared, whatever form the codes take."""
    lengths = [15 if codes_zstd else 16, 8, 0]  # valid for 64 kept values with b = 0
    lengths[which] = length
    data = _claim([64, 64], (lengths[0], lengths[1], lengths[2]), codes_zstd)
    field = ("codes", "unary", "remainders")[which]
    err = _bounded(lambda: reject(data, {"w": (64, 64)}))
    assert err.field == f"tensors[0].{field}"


def _rle_frame(declared: int, blocks: int) -> bytes:
    """A zstd frame declaring ``declared`` bytes of content (single segment, an 8-byte content
    size) and holding ``blocks`` RLE blocks of 128 KiB of zeros each: a few bytes per block."""
    out = b"\x28\xb5\x2f\xfd\xe0" + struct.pack("<Q", declared)
    for i in range(blocks):
        last = int(i == blocks - 1)
        out += struct.pack("<I", last | 1 << 1 | 131072 << 3)[:3] + b"\x00"
    return out


@pytest.mark.parametrize(
    "frame",
    [
        _rle_frame(100 * 2**20, 800),  # claims and holds 100 MiB
        _rle_frame(4096, 800),  # claims the right size, holds 100 MiB
        _rle_frame(2**64 - 2, 1),  # claims 16 EiB
    ],
    ids=["claims-100-mib", "holds-100-mib", "claims-16-eib"],
)
def test_zstd_bombs_in_the_codes_are_refused_in_bounded_memory(frame: bytes) -> None:
    """A 1024x1024 tensor keeps 16,384 values: 4,096 bytes of codes, so a frame of them must be
    shorter than that, and its content exactly that. A frame inflating to 100 MiB (a few bytes
    per 128 KiB block) fits under the length rule, but is refused from its frame header or
    decompressed into no more than the 4,096 bytes the model allows."""
    assert len(frame) < 4096
    n = 16384
    entry = ["w", [1024, 1024], 0, ref.stats_bytes(0.0, (0.0,) * 4), 0, 0, 0, 0, 1]
    header = {"run": "", "round": 0, "node": "", "base": "", "tile": 64, "topk": 64}
    header.update(steps=0, tokens=0)
    record = (frame, b"\xff" * (n // 8), b"")  # every gap 0 with b = 0: a valid unary stream
    data = ref.build_payload({**header, "tensors": [entry]}, [record])
    err = _bounded(lambda: reject(data, {"w": (1024, 1024)}))
    assert err.field == "tensors[0].codes"


def test_huge_declared_stream_lengths_are_bounded_by_the_model() -> None:
    """Streams far longer than the model could need are refused by the length rules, even
    with the bytes present behind valid checksums, and by every reader, whole or partial."""
    data = with_sections("a", unary=b"\x00" * 200_000)
    assert reject(data).field == "tensors[0].unary"
