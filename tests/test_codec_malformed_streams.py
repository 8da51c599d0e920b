"""Malformed payloads, inside the tensor records: statistics, codes, index streams, trailing
bytes and zstd frames, and bounded work on enormous claims.

Every one must raise PayloadError naming the field, and nothing else.
"""

from __future__ import annotations

import copy
import struct
import time
import tracemalloc
from typing import Any

import hypothesis.strategies as st
import msgpack
import pytest
import reference_codec as ref
import zstandard
from hypothesis import given
from malformed_fixtures import (
    BODY,
    FUZZ,
    MODEL,
    SMALL,
    check_valid_or_rejected,
    mutated,
    record,
    reject,
    rewrap,
    set_field,
)

from protocol.codec import read_payload
from protocol.envelope import wrap_body

# ---- statistics -----------------------------------------------------------------------------

FLT_MAX = 3.4028234663852886e38


def stats(shift: float, *levels: float) -> bytes:
    return struct.pack("<5f", shift, *levels)


@pytest.mark.parametrize(
    "value",
    [
        stats(float("nan"), 0, 0, 0, 0),
        stats(0, float("inf"), 0, 0, 0),
        stats(0, 0, 0, 0, float("-inf")),
        stats(0, 0, float("nan"), 0, 0),
        stats(FLT_MAX, 0, 0, 0, FLT_MAX),  # both finite, the sum overflows to inf
        stats(-FLT_MAX, -FLT_MAX, 0, 0, 0),
        struct.pack("<5I", 0x7FC00001, 0, 0, 0, 0),  # a signalling-style NaN pattern
        b"\x00" * 19,
        b"\x00" * 21,
        b"",
        "\x00" * 20,
        [0.0] * 5,
        None,
    ],
)
def test_bad_statistics(value: Any) -> None:
    assert reject(mutated(set_field("a", "stats", value))).field == "tensors[0].stats"


def test_extreme_but_finite_statistics_are_accepted() -> None:
    data = mutated(set_field("a", "stats", stats(FLT_MAX / 2, -FLT_MAX / 2, 0, 1e-45, FLT_MAX / 2)))
    table = read_payload(data, MODEL).tensors["a"].table.tolist()
    assert table == [0.0, FLT_MAX / 2, FLT_MAX / 2, FLT_MAX]


# ---- codes ----------------------------------------------------------------------------------


def codes_of(name: str) -> bytes:
    return BODY["tensors"][record(name)][4]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("a", codes_of("a")[:-1]),
        ("a", codes_of("a") + b"\x00"),
        ("a", b""),
        ("b", codes_of("b")[:-1] + bytes([codes_of("b")[-1] | 0x01])),  # padding bit set
        ("b", codes_of("b")[:-1] + bytes([codes_of("b")[-1] | 0x3F])),
        ("c", bytes([codes_of("c")[0] | 0x01])),
        ("c", b""),
        ("c", b"\x00\x00"),
        ("a", "codes"),
        ("a", None),
        ("a", 0),
    ],
)
def test_bad_codes(name: str, value: Any) -> None:
    err = reject(mutated(set_field(name, "codes", value)))
    assert err.field == f"tensors[{record(name)}].codes"


# ---- index streams --------------------------------------------------------------------------


def streams_of(name: str) -> tuple[int, bytes, bytes]:
    rec = BODY["tensors"][record(name)]
    return rec[2], rec[5], rec[6]


def with_streams(name: str, rice_bits: int, unary: Any, rem: Any) -> bytes:
    def fn(body: dict) -> None:
        rec = body["tensors"][record(name)]
        rec[2], rec[5], rec[6] = rice_bits, unary, rem

    return mutated(fn)


def with_gaps(name: str, gaps: list[int], rice_bits: int) -> bytes:
    unary, rem = ref.rice_streams(gaps, rice_bits)
    return with_streams(name, rice_bits, unary, rem)


def valid_gaps(name: str) -> list[int]:
    return ref.gaps_of(read_payload(SMALL, MODEL).tensors[name].positions.tolist())


@pytest.mark.parametrize("rice_bits", [-1, 21, 32, 64, 65, 2**64 - 1, 1.0, "2", None, True])
def test_bad_rice_bits(rice_bits: Any) -> None:
    _, unary, rem = streams_of("a")
    err = reject(with_streams("a", rice_bits, unary, rem))
    assert err.field == "tensors[0].rice_bits"


def _set_padding_bit(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] | 0x01])


def _unary_cases() -> list[tuple[str, str, bytes, str]]:
    unary = streams_of("a")[1]
    return [
        ("unary-truncated", "a", unary[:-1], "unary"),
        ("unary-empty", "a", b"", "unary"),
        ("unary-extra-zero-byte", "a", unary + b"\x00", "unary"),
        ("unary-extra-ones", "a", unary + b"\xff", "unary"),
        ("unary-one-more-one-in-padding", "a", _set_padding_bit(unary), "unary"),
        ("unary-huge", "a", b"\x00" * 2_000 + b"\x80", "unary"),
        ("unary-all-zero", "a", b"\x00" * len(unary), "unary"),
    ]


@pytest.mark.parametrize(
    ("name", "unary", "field"), [c[1:] for c in _unary_cases()], ids=[c[0] for c in _unary_cases()]
)
def test_bad_unary_streams(name: str, unary: bytes, field: str) -> None:
    b, _, rem = streams_of(name)
    err = reject(with_streams(name, b, unary, rem))
    assert err.field.startswith(f"tensors[{record(name)}]")
    assert field in err.field


def test_too_few_and_too_many_codes() -> None:
    gaps = valid_gaps("a")
    for wrong in (gaps[:-1], [*gaps, 0], gaps[:-4], [*gaps, 0, 0, 0, 0]):
        err = reject(with_gaps("a", wrong, 2))
        assert err.field.startswith("tensors[0]")


def test_bad_remainder_streams() -> None:
    b, unary, rem = streams_of("a")
    assert b > 0  # so that the remainder stream is not empty
    for bad in (rem[:-1], rem + b"\x00", b"", "rem", None):
        err = reject(with_streams("a", b, unary, bad))
        assert err.field == "tensors[0].remainders", bad
    # Remainders with rice_bits = 0 must be empty.
    gaps = valid_gaps("a")
    unary0, _ = ref.rice_streams(gaps, 0)
    assert read_payload(with_streams("a", 0, unary0, b""), MODEL)
    assert reject(with_streams("a", 0, unary0, b"\x00")).field == "tensors[0].remainders"


@pytest.mark.parametrize("rice_bits", [1, 2, 3, 5])
def test_non_zero_padding_in_the_remainder_stream(rice_bits: int) -> None:
    """Tensor "b" keeps 5 positions (tiles of 2): 5 * rice_bits remainder bits leave padding."""
    unary, rem = ref.rice_streams(valid_gaps("b"), rice_bits)
    assert len(rem) * 8 > 5 * rice_bits
    assert read_payload(with_streams("b", rice_bits, unary, rem), MODEL)
    err = reject(with_streams("b", rice_bits, unary, _set_padding_bit(rem)))
    assert err.field == f"tensors[{record('b')}].remainders"


@pytest.mark.parametrize("rice_bits", [0, 1, 2, 3, 4, 5, 20])
def test_positions_outside_the_tile_are_rejected(rice_bits: int) -> None:
    """Tile "a" is 4x4 (16 positions) keeping 4: gaps summing past position 15 are rejected,
    the largest valid layout (12, 13, 14, 15) is accepted."""
    n_tiles, k, tile_len = 6, 4, 16
    ok = [0, 0, 0, 0] * n_tiles
    data = with_gaps("a", [*ok[:-k], 12, 0, 0, 0], rice_bits)
    positions = read_payload(data, MODEL).tensors["a"].positions.tolist()
    assert positions[-1] == [12, 13, 14, 15]
    bads = [[13, 0, 0, 0], [0, 0, 0, 13], [tile_len, 0, 0, 0], [0, 5, 5, 5]]
    if rice_bits >= 10:  # a 2**20 gap in unary below that would exceed the body limit first
        bads.append([2**20, 0, 0, 0])
    for bad in bads:
        assert sum(bad) + k > tile_len
        for where in (0, n_tiles - 1):
            gaps = ok[: where * k] + bad + ok[where * k + k :]
            assert len(gaps) == n_tiles * k
            err = reject(with_gaps("a", gaps, rice_bits))
            assert err.field.startswith("tensors[0]")


@FUZZ
@given(
    gaps=st.lists(st.integers(0, 20), min_size=24, max_size=24),
    rice_bits=st.integers(0, 5),
)
def test_any_gap_sequence_decodes_exactly_or_is_rejected(gaps: list[int], rice_bits: int) -> None:
    """Positions are gaps' running sums, so they are strictly increasing by construction:
    repeated or decreasing positions cannot be expressed. Any coded gap sequence either decodes
    to exactly those positions (when all fit in the 16-position tiles) or is rejected."""
    unary, rem = ref.rice_streams(gaps, rice_bits)
    expected = ref.decode_positions(rice_bits, unary, rem, n_tiles=6, k=4)
    data = with_streams("a", rice_bits, unary, rem)
    if all(tile[-1] < 16 for tile in expected):
        assert read_payload(data, MODEL).tensors["a"].positions.tolist() == expected
    else:
        assert reject(data).field.startswith("tensors[0]")


@FUZZ
@given(
    which=st.sampled_from(["unary", "remainders", "both"]),
    flips=st.lists(st.integers(0, 10**6), min_size=1, max_size=3),
    rice_bits=st.integers(0, 4),
)
def test_corrupt_index_streams_fail_or_stay_in_range(
    which: str, flips: list[int], rice_bits: int
) -> None:
    """Bit flips in the unary and remainder streams (rice_bits varied so both are non-trivial):
    either PayloadError, or strictly increasing positions inside every tile."""
    unary, rem = ref.rice_streams(valid_gaps("a"), rice_bits)
    u, r = bytearray(unary), bytearray(rem)
    for f in flips:
        target = u if which == "unary" or (which == "both" and f % 2) or not r else r
        target[(f // 8) % len(target)] ^= 0x80 >> (f % 8)
    check_valid_or_rejected(with_streams("a", rice_bits, bytes(u), bytes(r)))


@pytest.mark.parametrize("field", ["unary", "remainders"])
@pytest.mark.parametrize("value", ["text", None, 0, [1]])
def test_bad_stream_types(field: str, value: Any) -> None:
    err = reject(mutated(set_field("a", field, value)))
    assert err.field == f"tensors[0].{field}"


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
        "tensors": [["w", shape, 0, stats(0, 0, 0, 0, 0), b"", b"", b""]],
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
