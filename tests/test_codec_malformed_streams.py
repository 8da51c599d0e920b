"""Malformed payloads, inside the tensor records and their header entries: statistics, the
declared lengths and CRC, raw codes and index streams.

Every one must raise PayloadError naming the field, and nothing else, in every reader (whole,
lazy, partial). Codes stored as a zstd frame are ``test_codec_malformed_zstd.py``'s; odd
msgpack documents, other versions and enormous claims are in
``test_codec_malformed_encoding.py``.
"""

from __future__ import annotations

import struct
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given

from protocol.codec import read_payload
from support import reference_codec as ref
from support.malformed_fixtures import (
    FUZZ,
    HEADER,
    MODEL,
    RECORDS,
    SMALL,
    check_valid_or_rejected,
    mutated,
    record,
    reject,
    set_field,
    with_sections,
)

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


def test_non_finite_statistics_fail_the_readers_of_that_record_only() -> None:
    """Finiteness is a record-level rule (FORMAT.md): a reader of the other tensors accepts."""
    data = mutated(set_field("b", "stats", stats(float("nan"), 0, 0, 0, 0)))
    assert reject(data).field == "tensors[1].stats"
    assert sorted(read_payload(data, MODEL, only=["a", "c"]).tensors) == ["a", "c"]


def test_extreme_but_finite_statistics_are_accepted() -> None:
    data = mutated(set_field("a", "stats", stats(FLT_MAX / 2, -FLT_MAX / 2, 0, 1e-45, FLT_MAX / 2)))
    table = read_payload(data, MODEL).tensors["a"].table.tolist()
    assert table == [0.0, FLT_MAX / 2, FLT_MAX / 2, FLT_MAX]


# ---- declared lengths and the CRC -----------------------------------------------------------


def entry_of(name: str) -> list:
    """The small payload's header entry of ``name`` (``ref.ENTRY_FIELDS``)."""
    return list(HEADER["tensors"][record(name)])


@pytest.mark.parametrize("name", ["a", "b", "c"])
@pytest.mark.parametrize("field", ["codes", "unary", "remainders"])
@pytest.mark.parametrize("value", [-1, 2**62 + 1, 2**64 - 1, 1.0, "6", None, True, b"\x06", [6]])
def test_bad_length_types(name: str, field: str, value: Any) -> None:
    err = reject(mutated(set_field(name, f"{field}_len", value)))
    assert err.field == f"tensors[{record(name)}].{field}"


@pytest.mark.parametrize("name", ["a", "b", "c"])
@pytest.mark.parametrize("field", ["codes", "unary", "remainders"])
@pytest.mark.parametrize("delta", [-1, 1, 1000])
def test_wrong_declared_lengths(name: str, field: str, delta: int) -> None:
    """A length one off (or far off) moves every later offset: all readers refuse it, either
    by the model's length rule for the field or, where the length is still possible, by the
    total size."""
    i = record(name)
    at = ref.ENTRY_FIELDS.index(f"{field}_len")
    declared = entry_of(name)[at] + delta
    if declared < 0:
        return
    err = reject(mutated(set_field(name, f"{field}_len", declared)))
    assert err.field in (f"tensors[{i}].{field}", "size")


@pytest.mark.parametrize("crc", [-1, 2**32, 2**64 - 1, 1.5, "0", None, b"\x00" * 4])
def test_bad_crc_types(crc: Any) -> None:
    assert reject(mutated(set_field("b", "crc32", crc))).field == "tensors[1].crc32"


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_a_wrong_crc_fails_the_readers_of_that_record_only(name: str) -> None:
    i = record(name)
    wrong = entry_of(name)[7] ^ 1
    data = mutated(set_field(name, "crc32", wrong))
    assert reject(data).field == f"tensors[{i}].crc32"
    others = [n for n in MODEL if n != name]
    assert sorted(read_payload(data, MODEL, only=others).tensors) == sorted(others)


# ---- codes ----------------------------------------------------------------------------------


def codes_of(name: str) -> bytes:
    return RECORDS[record(name)][0]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("a", codes_of("a")[:-1]),  # the declared length no longer fits the geometry
        ("a", codes_of("a") + b"\x00"),
        ("a", b""),
        ("b", codes_of("b")[:-1] + bytes([codes_of("b")[-1] | 0x01])),  # padding bit set
        ("b", codes_of("b")[:-1] + bytes([codes_of("b")[-1] | 0x3F])),
        ("c", bytes([codes_of("c")[0] | 0x01])),
        ("c", b""),
        ("c", b"\x00\x00"),
    ],
)
def test_bad_codes(name: str, value: bytes) -> None:
    err = reject(with_sections(name, codes=value))
    assert err.field == f"tensors[{record(name)}].codes"


# ---- index streams --------------------------------------------------------------------------


def streams_of(name: str) -> tuple[int, bytes, bytes]:
    i = record(name)
    return entry_of(name)[2], RECORDS[i][1], RECORDS[i][2]


def with_streams(name: str, rice_bits: Any, unary: bytes, rem: bytes) -> bytes:
    return with_sections(name, rice_bits=rice_bits, unary=unary, remainders=rem)


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
    for bad in (rem[:-1], rem + b"\x00", b""):
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
    bads = [[13, 0, 0, 0], [0, 0, 0, 13], [tile_len, 0, 0, 0], [0, 5, 5, 5], [2**20, 0, 0, 0]]
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
