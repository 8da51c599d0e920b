"""Malformed payloads, bytes and structure: truncations, bit flips, random bytes, the prefix,
the header's keys and types, and names and shapes against the model.

Every one must raise PayloadError naming the field, and nothing else, in every reader (whole,
lazy, partial: ``support.malformed_fixtures.reject``); the rest of the corpus (statistics,
codes, index streams, declared lengths, odd msgpack, bounded work) is in
test_codec_malformed_streams.py and test_codec_malformed_encoding.py.
"""

from __future__ import annotations

import copy
import struct
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given

from protocol.codec import read_payload
from support import reference_codec as ref
from support.malformed_fixtures import (
    BIG,
    BIG_MODEL,
    CONSTANT,
    CONSTANT_MODEL,
    ENCODED,
    FUZZ,
    HEADER,
    MODEL,
    RECORDS,
    SMALL,
    TILE,
    TOPK,
    ZSTD,
    ZSTD_HEADER,
    ZSTD_MODEL,
    check_valid_or_rejected,
    mutated,
    record,
    reject,
    set_field,
)

# "constant" and "zstd" hold zstd-coded records: truncations and flips reach their frames too.
PAYLOADS = {
    "small": (SMALL, MODEL),
    "constant": (CONSTANT, CONSTANT_MODEL),
    "zstd": (ZSTD, ZSTD_MODEL),
}


def test_the_fixtures_are_valid() -> None:
    assert SMALL == ENCODED  # the independent writer gives the encoder's bytes
    assert read_payload(SMALL, MODEL).topk == TOPK
    assert read_payload(ref.build_payload(HEADER, RECORDS), MODEL).node_id == "n"
    assert read_payload(CONSTANT, CONSTANT_MODEL).tile == 16
    assert read_payload(BIG, BIG_MODEL).tile == 64
    # Which records are zstd frames (ref.split_payload checked each frame's layout and CRC).
    forms = {
        name: [e[ref.ZSTD] for e in ref.split_payload(data).header["tensors"]]
        for name, (data, _) in PAYLOADS.items()
    }
    assert forms == {"small": [0, 0, 0], "constant": [1], "zstd": [0, 1]}
    assert [e[4] for e in ZSTD_HEADER["tensors"]][1] < 88  # "w": a frame shorter than 88 bytes
    assert read_payload(ZSTD, ZSTD_MODEL).tensors["w"].geometry.n_kept == 350
    geo = read_payload(SMALL, MODEL).tensors
    assert (geo["a"].geometry.n_kept, geo["b"].geometry.n_kept, geo["c"].geometry.n_kept) == (
        24,
        5,
        1,
    )


# ---- truncation, bit flips, random bytes ----------------------------------------------------


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_every_truncation_is_rejected(payload: str) -> None:
    data, model = PAYLOADS[payload]
    header_end = 14 + ref.split_payload(data).header_length
    for n in range(len(data)):
        err = reject(data[:n], model)
        assert err.field.startswith("header") if n < header_end else err.field == "size"


def test_sampled_truncations_of_a_larger_payload_are_rejected() -> None:
    offsets = sorted({*range(0, 40), *range(0, len(BIG), 997), len(BIG) - 1})
    for n in offsets:
        reject(BIG[:n], BIG_MODEL)


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_every_single_bit_flip_is_rejected(payload: str) -> None:
    """CRC-32 detects every single-bit error in the header and in each record; flips in the
    prefix break the magic, version, flags, length or checksum. A flip inside a record is
    found by the readers of that record only; every other error by every reader."""
    data, model = PAYLOADS[payload]
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 0x80 >> (i % 8)
        reject(bytes(flipped), model)


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_every_bit_flip_behind_valid_checksums_is_rejected_or_consistent(payload: str) -> None:
    """Flip each bit after the version and flags and fix the checksums: deeper validation must
    catch it, or the result must still be a well-formed payload (a flipped level bit is just
    another level)."""
    data, model = PAYLOADS[payload]
    for i in range(6 * 8, len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 0x80 >> (i % 8)
        check_valid_or_rejected(ref.fix_checksums(bytes(flipped)), model)


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_are_rejected(data: bytes) -> None:
    reject(data)


@FUZZ
@given(header=st.binary(max_size=300), tail=st.binary(max_size=20))
def test_random_headers_behind_a_valid_prefix_are_rejected(header: bytes, tail: bytes) -> None:
    reject(ref.wrap_header(header, tail))


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 3),
)
def test_random_byte_edits_behind_valid_checksums(edits: list[tuple[int, int]], cut: int) -> None:
    raw = bytearray(SMALL)
    for at, value in edits:
        raw[14 + at % (len(raw) - 14)] = value
    check_valid_or_rejected(ref.fix_checksums(bytes(raw[: len(raw) - cut])))


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)


def leaf_paths(obj: Any, path: tuple = ()) -> list[tuple]:
    """Every path (sequence of keys / indices) to a node of the header, the root excluded."""
    out = []
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for key, value in items:
        out.append((*path, key))
        out.extend(leaf_paths(value, (*path, key)))
    return out


HEADER_PATHS = leaf_paths(HEADER)


@FUZZ
@given(path=st.sampled_from(HEADER_PATHS), value=msgpack_values)
def test_any_header_node_replaced_by_any_value(path: tuple, value: Any) -> None:
    header = copy.deepcopy(HEADER)
    node = header
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    check_valid_or_rejected(ref.build_payload(header, RECORDS, sync=False))


@FUZZ
@given(which=st.integers(0, 8), value=st.binary(max_size=40))
def test_any_record_section_replaced_by_any_bytes(which: int, value: bytes) -> None:
    """Lengths and CRC made to match: the model's length rules or the record's own checks
    must catch it, or it decodes consistently."""
    records = [list(r) for r in RECORDS]
    records[which // 3][which % 3] = value
    rebuilt = [(r[0], r[1], r[2]) for r in records]
    check_valid_or_rejected(ref.build_payload(HEADER, rebuilt))


# ---- the prefix -----------------------------------------------------------------------------

_RAW = SMALL[14 : 14 + ref.split_payload(SMALL).header_length]
_DATA = SMALL[14 + len(_RAW) :]


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"", "header"),
        (b"SLCP\x02\x00\x00\x00\x00", "header"),
        (SMALL[:13], "header"),
        (b"XLCP" + SMALL[4:], "header.magic"),
        (b"slcp" + SMALL[4:], "header.magic"),
        (b"SLCP\x00" + SMALL[5:], "header.version"),
        (b"SLCP\x01" + SMALL[5:], "header.version"),
        (b"SLCP\x02" + SMALL[5:], "header.version"),
        (b"SLCP\x04" + SMALL[5:], "header.version"),
        (b"SLCP\xff" + SMALL[5:], "header.version"),
        (SMALL[:5] + b"\x01" + SMALL[6:], "header.flags"),
        (SMALL[:5] + b"\x80" + SMALL[6:], "header.flags"),
        (SMALL[:5] + b"\xff" + SMALL[6:], "header.flags"),
        (SMALL[:10] + struct.pack("<I", 0) + SMALL[14:], "header.crc32"),
        (SMALL + b"\x00", "size"),
        (SMALL + SMALL, "size"),
        (SMALL[:-1], "size"),
        (ref.wrap_header(_RAW, _DATA, version=1), "header.version"),
        (ref.wrap_header(_RAW, _DATA, flags=4), "header.flags"),
        (ref.wrap_header(_RAW, _DATA, length=2**32 - 1), "header.length"),
        (ref.wrap_header(_RAW, _DATA, length=10**6), "header.length"),
        (ref.wrap_header(_RAW, _DATA, length=len(_RAW) + len(_DATA) + 1), "header"),
        (ref.wrap_header(_RAW[:-1], _RAW[-1:] + _DATA), "header"),  # L one short: cut document
        (ref.wrap_header(b"", _RAW + _DATA), "header"),  # L = 0
        (ref.wrap_header(_RAW, _DATA, crc=0), "header.crc32"),
    ],
)
def test_bad_prefixes(data: bytes, field: str) -> None:
    assert reject(data).field == field


@pytest.mark.parametrize("data", ["SLCP", None, 17, [1, 2], bytearray(b"SLCP")])
def test_non_bytes_or_short_input(data: Any) -> None:
    reject(data)


def test_bytes_like_inputs_are_accepted() -> None:
    # Annotated as bytes, but any buffer is read: these are what a socket or mmap hands over.
    assert read_payload(bytearray(SMALL), MODEL).round == 1  # type: ignore[arg-type]
    assert read_payload(memoryview(SMALL), MODEL).round == 1  # type: ignore[arg-type]


# ---- the header's structure -----------------------------------------------------------------


def _without(key: str) -> Callable[[dict], None]:
    return lambda header: header.pop(key) and None


def _with(key: str, value: Any) -> Callable[[dict], None]:
    return lambda header: header.__setitem__(key, value)


HEADER_CASES: list[tuple[str, Callable[[dict], Any], str]] = [
    *[(f"missing-{k}", _without(k), "header") for k in sorted(HEADER)],
    ("extra-key", _with("extra", 1), "header"),
    ("bytes-key", lambda h: h.__setitem__(b"x", 1), "header"),
    ("run-int", _with("run", 1), "header.run"),
    ("run-bytes", _with("run", b"run"), "header.run"),
    ("run-long", _with("run", "r" * 257), "header.run"),
    ("node-none", _with("node", None), "header.node"),
    ("node-long", _with("node", "n" * 1000), "header.node"),
    ("base-list", _with("base", ["f"]), "header.base"),
    ("round-negative", _with("round", -1), "header.round"),
    ("round-too-big", _with("round", 2**63), "header.round"),
    ("round-max-u64", _with("round", 2**64 - 1), "header.round"),
    ("round-float", _with("round", 1.0), "header.round"),
    ("round-bool", _with("round", True), "header.round"),
    ("round-str", _with("round", "1"), "header.round"),
    ("tile-huge", _with("tile", 2**40), "header.tile"),
    ("tile-float", _with("tile", 4.0), "header.tile"),
    ("tile-negative", _with("tile", -4), "header.tile"),
    ("tile-bool", _with("tile", True), "header.tile"),
    ("topk-zero", _with("topk", 0), "header.topk"),
    ("topk-over-tile2", _with("topk", TILE * TILE + 1), "header.topk"),
    ("topk-huge", _with("topk", 2**63), "header.topk"),
    ("topk-str", _with("topk", "4"), "header.topk"),
    ("topk-bool", _with("topk", True), "header.topk"),
    ("steps-negative", _with("steps", -1), "header.steps"),
    ("steps-too-big", _with("steps", 2**32), "header.steps"),
    ("steps-float", _with("steps", 3.0), "header.steps"),
    ("steps-bool", _with("steps", True), "header.steps"),
    ("tokens-negative", _with("tokens", -1), "header.tokens"),
    ("tokens-too-big", _with("tokens", 2**63), "header.tokens"),
    ("tokens-str", _with("tokens", "9"), "header.tokens"),
    ("tensors-map", _with("tensors", {"a": 1}), "header.tensors"),
    ("tensors-bytes", _with("tensors", b""), "header.tensors"),
    ("tensors-none", _with("tensors", None), "header.tensors"),
    ("tensors-empty", _with("tensors", []), "header.tensors"),
    ("entry-not-list", lambda h: h["tensors"].__setitem__(0, "a"), "tensors[0]"),
    ("entry-short", lambda h: h["tensors"][0].pop() and None, "tensors[0]"),
    ("entry-long", lambda h: h["tensors"][0].append(0), "tensors[0]"),
    (
        "entry-v1-shaped",
        lambda h: h["tensors"][0].__setitem__(slice(4, 8), [b""] * 3),
        "tensors[0]",
    ),
    ("entry-map", lambda h: h["tensors"].__setitem__(0, {"name": "a"}), "tensors[0]"),
]


@pytest.mark.parametrize(
    ("mutate", "field"), [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES]
)
def test_bad_header_structure(mutate: Callable[[dict], Any], field: str) -> None:
    assert reject(mutated(mutate)).field == field


@pytest.mark.parametrize("header", [list(HEADER.values()), 7, b"\x00", None, "header", [], {}, 1.5])
def test_header_that_is_not_a_map(header: Any) -> None:
    assert reject(ref.build_payload(header, RECORDS, sync=False)).field == "header"


@pytest.mark.parametrize("tile", [0, 1025, 2**31])
def test_bad_tile_is_reported_as_the_tile(tile: int) -> None:
    """A tile outside [1, 1024] must be blamed on ``header.tile``, not on another field."""
    assert reject(mutated(_with("tile", tile))).field == "header.tile"


@pytest.mark.parametrize(("tile", "topk"), [(8, 4), (2, 4), (4, 5), (4, 3), (1, 1), (64, 64)])
def test_codec_parameters_that_do_not_fit_the_records(tile: int, topk: int) -> None:
    """Valid-looking tile/topk that are not the ones the records were coded with: the declared
    lengths no longer fit the geometry, or the streams do not."""

    def fn(header: dict) -> None:
        header["tile"], header["topk"] = tile, topk

    err = reject(mutated(fn))
    assert err.field.startswith("tensors[")


# ---- names and shapes against the model -----------------------------------------------------


def _swap(header: dict) -> None:
    t = header["tensors"]
    t[0], t[1] = t[1], t[0]


def _duplicate(header: dict) -> None:
    header["tensors"][1] = copy.deepcopy(header["tensors"][0])


def _rename(header: dict) -> None:
    header["tensors"][2][0] = "d"


def _extra(header: dict) -> None:
    entry = copy.deepcopy(header["tensors"][2])
    entry[0] = "d"
    header["tensors"].append(entry)


NAME_CASES: list[tuple[str, Callable[[dict], Any], dict]] = [
    ("missing", lambda h: h["tensors"].pop() and None, MODEL),
    ("extra", _extra, MODEL),
    ("unsorted", _swap, MODEL),
    ("duplicated", _duplicate, MODEL),
    ("renamed", _rename, MODEL),
    ("model-has-more", lambda h: None, {**MODEL, "d": (3,)}),
    ("model-has-fewer", lambda h: None, {"a": (8, 12), "b": (10,)}),
    ("empty-model", lambda h: None, {}),
]


@pytest.mark.parametrize(
    ("mutate", "model"), [c[1:] for c in NAME_CASES], ids=[c[0] for c in NAME_CASES]
)
def test_names_must_match_the_model(mutate: Callable[[dict], Any], model: dict) -> None:
    assert reject(mutated(mutate), model).field == "header.tensors"


@pytest.mark.parametrize(
    ("name", "shape", "field"),
    [
        ("a", [12, 8], "shape"),
        ("a", [8, 12, 1], "shape"),
        ("a", [96], "shape"),
        ("a", [8, 2**40], "shape"),
        ("a", [8, 2**41], "shape"),
        ("a", [2**40] * 8, "shape"),
        ("a", [1] * 9, "shape"),
        ("a", [8, -12], "shape"),
        ("a", [8, 12.0], "shape"),
        ("a", [8, True], "shape"),
        ("a", "8x12", "shape"),
        ("a", {"rows": 8}, "shape"),
        ("a", None, "shape"),
        ("c", [1], "shape"),
        ("c", [], None),  # the valid scalar shape, for contrast
        ("b", [10, 1], "shape"),
    ],
)
def test_shapes_must_match_the_model(name: str, shape: Any, field: str | None) -> None:
    data = mutated(set_field(name, "shape", shape))
    if field is None:
        assert read_payload(data, MODEL).tensors[name].geometry.shape == MODEL[name]
        return
    err = reject(data)
    assert err.field == f"tensors[{record(name)}].{field}"


@pytest.mark.parametrize("name", [1, None, b"a", "a" * 257, ["a"]])
def test_bad_name_types(name: Any) -> None:
    assert reject(mutated(set_field("a", "name", name))).field.startswith("tensors[0].name")
