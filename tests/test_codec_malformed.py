"""Malformed payloads, bytes and structure: truncations, bit flips, random bytes, headers,
the body's keys and types, and names and shapes against the model.

Every one must raise PayloadError naming the field, and nothing else; the rest of the corpus
(statistics, codes, index streams, zstd, bounded work) is in test_codec_malformed_streams.py.
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
from protocol.envelope import wrap_body
from support.malformed_fixtures import (
    BIG,
    BIG_MODEL,
    BODY,
    ENCODED,
    FUZZ,
    MODEL,
    SMALL,
    TILE,
    TOPK,
    ZMODEL,
    ZSTD_SMALL,
    check_valid_or_rejected,
    mutated,
    record,
    reject,
    rewrap,
    set_field,
)


def test_the_fixtures_are_valid() -> None:
    assert read_payload(ENCODED, MODEL).topk == TOPK
    assert read_payload(SMALL, MODEL).topk == TOPK
    assert read_payload(rewrap(BODY), MODEL).node_id == "n"
    assert read_payload(rewrap(BODY, zstd=True), MODEL).run_id == "run"
    assert SMALL[5] == 0 and ZSTD_SMALL[5] == 1  # one plain body, one zstd frame
    assert read_payload(ZSTD_SMALL, ZMODEL).tile == 16
    assert read_payload(BIG, BIG_MODEL).tile == 64
    geo = read_payload(SMALL, MODEL).tensors
    assert (geo["a"].geometry.n_kept, geo["b"].geometry.n_kept, geo["c"].geometry.n_kept) == (
        24,
        5,
        1,
    )


# ---- truncation, bit flips, random bytes ----------------------------------------------------


@pytest.mark.parametrize("payload", ["small", "zstd"])
def test_every_truncation_is_rejected(payload: str) -> None:
    data, model = (SMALL, MODEL) if payload == "small" else (ZSTD_SMALL, ZMODEL)
    for n in range(len(data)):
        err = reject(data[:n], model)
        assert err.field.startswith("header")


def test_sampled_truncations_of_a_larger_payload_are_rejected() -> None:
    offsets = sorted({*range(0, 40), *range(0, len(BIG), 997), len(BIG) - 1})
    for n in offsets:
        reject(BIG[:n], BIG_MODEL)


@pytest.mark.parametrize("payload", ["small", "zstd"])
def test_every_single_bit_flip_is_rejected(payload: str) -> None:
    """CRC-32 detects every single-bit error in the body; flips in the header break the magic,
    version, flags or checksum."""
    data, model = (SMALL, MODEL) if payload == "small" else (ZSTD_SMALL, ZMODEL)
    for i in range(len(data) * 8):
        flipped = bytearray(data)
        flipped[i // 8] ^= 0x80 >> (i % 8)
        reject(bytes(flipped), model)


@pytest.mark.parametrize("payload", ["small", "zstd"])
def test_every_bit_flip_behind_a_valid_crc_is_rejected_or_consistent(payload: str) -> None:
    """Flip each bit of the stored body and fix the checksum: deeper validation must catch it,
    or the result must still be a well-formed payload (a flipped level bit is just another
    level)."""
    data, model = (SMALL, MODEL) if payload == "small" else (ZSTD_SMALL, ZMODEL)
    flags, body = data[5], data[10:]
    for i in range(len(body) * 8):
        flipped = bytearray(body)
        flipped[i // 8] ^= 0x80 >> (i % 8)
        check_valid_or_rejected(wrap_body(bytes(flipped), flags), model)


@FUZZ
@given(data=st.binary(max_size=300))
def test_random_bytes_are_rejected(data: bytes) -> None:
    reject(data)


@FUZZ
@given(body=st.binary(max_size=300), flags=st.sampled_from([0, 1]))
def test_random_bodies_behind_a_valid_header_are_rejected(body: bytes, flags: int) -> None:
    reject(wrap_body(body, flags))


@FUZZ
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 3),
)
def test_random_byte_edits_behind_a_valid_crc(edits: list[tuple[int, int]], cut: int) -> None:
    raw = bytearray(SMALL[10:])
    for at, value in edits:
        raw[at % len(raw)] = value
    check_valid_or_rejected(wrap_body(bytes(raw[: len(raw) - cut]), 0))


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
    """Every path (sequence of keys / indices) to a node of the body, the root excluded."""
    out = []
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for key, value in items:
        out.append((*path, key))
        out.extend(leaf_paths(value, (*path, key)))
    return out


BODY_PATHS = leaf_paths(BODY)


@FUZZ
@given(path=st.sampled_from(BODY_PATHS), value=msgpack_values)
def test_any_node_replaced_by_any_value(path: tuple, value: Any) -> None:
    body = copy.deepcopy(BODY)
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    check_valid_or_rejected(rewrap(body))


# ---- the header -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"", "header"),
        (b"SLCP\x01\x00\x00\x00\x00", "header"),
        (b"XLCP" + SMALL[4:], "header.magic"),
        (b"slcp" + SMALL[4:], "header.magic"),
        (b"SLCP\x00" + SMALL[5:], "header.version"),
        (b"SLCP\x02" + SMALL[5:], "header.version"),
        (b"SLCP\xff" + SMALL[5:], "header.version"),
        (SMALL[:5] + b"\x02" + SMALL[6:], "header.flags"),
        (SMALL[:5] + b"\x80" + SMALL[6:], "header.flags"),
        (SMALL[:5] + b"\xff" + SMALL[6:], "header.flags"),
        (SMALL[:5] + b"\x01" + SMALL[6:], "body.zstd"),  # claims zstd, body is plain msgpack
        (SMALL[:6] + struct.pack("<I", 0) + SMALL[10:], "header.crc32"),
        (SMALL + b"\x00", "header.crc32"),
        (wrap_body(SMALL[10:], 0, version=2), "header.version"),
        (wrap_body(SMALL[10:], 4), "header.flags"),
    ],
)
def test_bad_headers(data: bytes, field: str) -> None:
    assert reject(data).field == field


@pytest.mark.parametrize("data", ["SLCP", None, 17, [1, 2], bytearray(b"SLCP")])
def test_non_bytes_or_short_input(data: Any) -> None:
    reject(data)


def test_bytes_like_inputs_are_accepted() -> None:
    # Annotated as bytes, but any buffer is read: these are what a socket or mmap hands over.
    assert read_payload(bytearray(SMALL), MODEL).round == 1  # type: ignore[arg-type]
    assert read_payload(memoryview(SMALL), MODEL).round == 1  # type: ignore[arg-type]


# ---- the body's structure -------------------------------------------------------------------


def _without(key: str) -> Callable[[dict], None]:
    return lambda body: body.pop(key) and None


def _with(key: str, value: Any) -> Callable[[dict], None]:
    return lambda body: body.__setitem__(key, value)


BODY_CASES: list[tuple[str, Callable[[dict], Any], str]] = [
    *[(f"missing-{k}", _without(k), "body") for k in sorted(BODY)],
    ("extra-key", _with("extra", 1), "body"),
    ("bytes-key", lambda b: b.__setitem__(b"x", 1), "body"),
    ("run-int", _with("run", 1), "body.run"),
    ("run-bytes", _with("run", b"run"), "body.run"),
    ("run-long", _with("run", "r" * 257), "body.run"),
    ("node-none", _with("node", None), "body.node"),
    ("node-long", _with("node", "n" * 1000), "body.node"),
    ("base-list", _with("base", ["f"]), "body.base"),
    ("round-negative", _with("round", -1), "body.round"),
    ("round-too-big", _with("round", 2**63), "body.round"),
    ("round-max-u64", _with("round", 2**64 - 1), "body.round"),
    ("round-float", _with("round", 1.0), "body.round"),
    ("round-bool", _with("round", True), "body.round"),
    ("round-str", _with("round", "1"), "body.round"),
    ("tile-huge", _with("tile", 2**40), "body.tile"),
    ("tile-float", _with("tile", 4.0), "body.tile"),
    ("tile-negative", _with("tile", -4), "body.tile"),
    ("tile-bool", _with("tile", True), "body.tile"),
    ("topk-zero", _with("topk", 0), "body.topk"),
    ("topk-over-tile2", _with("topk", TILE * TILE + 1), "body.topk"),
    ("topk-huge", _with("topk", 2**63), "body.topk"),
    ("topk-str", _with("topk", "4"), "body.topk"),
    ("topk-bool", _with("topk", True), "body.topk"),
    ("tensors-map", _with("tensors", {"a": 1}), "body.tensors"),
    ("tensors-bytes", _with("tensors", b""), "body.tensors"),
    ("tensors-none", _with("tensors", None), "body.tensors"),
    ("tensors-empty", _with("tensors", []), "body.tensors"),
    ("record-not-list", lambda b: b["tensors"].__setitem__(0, "a"), "tensors[0]"),
    ("record-short", lambda b: b["tensors"][0].pop() and None, "tensors[0]"),
    ("record-long", lambda b: b["tensors"][0].append(b""), "tensors[0]"),
    ("record-map", lambda b: b["tensors"].__setitem__(0, {"name": "a"}), "tensors[0]"),
]


@pytest.mark.parametrize(
    ("mutate", "field"), [c[1:] for c in BODY_CASES], ids=[c[0] for c in BODY_CASES]
)
def test_bad_body_structure(mutate: Callable[[dict], Any], field: str) -> None:
    assert reject(mutated(mutate)).field == field


@pytest.mark.parametrize("body", [list(BODY.values()), 7, b"\x00", None, "body", [], {}, 1.5])
def test_body_that_is_not_a_map(body: Any) -> None:
    assert reject(rewrap(body)).field == "body"
    assert reject(rewrap(body, zstd=True)).field == "body"


@pytest.mark.parametrize("tile", [0, 1025, 2**31])
def test_bad_tile_is_reported_as_the_tile(tile: int) -> None:
    """A tile outside [1, 1024] must be blamed on ``body.tile``, not on another field."""
    assert reject(mutated(_with("tile", tile))).field == "body.tile"


@pytest.mark.parametrize(("tile", "topk"), [(8, 4), (2, 4), (4, 5), (4, 3), (1, 1), (64, 64)])
def test_codec_parameters_that_do_not_fit_the_streams(tile: int, topk: int) -> None:
    """Valid-looking tile/topk that are not the ones the streams were coded with."""

    def fn(body: dict) -> None:
        body["tile"], body["topk"] = tile, topk

    err = reject(mutated(fn))
    assert err.field.startswith("tensors[")


# ---- names and shapes against the model -----------------------------------------------------


def _swap(body: dict) -> None:
    t = body["tensors"]
    t[0], t[1] = t[1], t[0]


def _duplicate(body: dict) -> None:
    body["tensors"][1] = copy.deepcopy(body["tensors"][0])


def _rename(body: dict) -> None:
    body["tensors"][2][0] = "d"


def _extra(body: dict) -> None:
    rec = copy.deepcopy(body["tensors"][2])
    rec[0] = "d"
    body["tensors"].append(rec)


NAME_CASES: list[tuple[str, Callable[[dict], Any], dict]] = [
    ("missing", lambda b: b["tensors"].pop() and None, MODEL),
    ("extra", _extra, MODEL),
    ("unsorted", _swap, MODEL),
    ("duplicated", _duplicate, MODEL),
    ("renamed", _rename, MODEL),
    ("model-has-more", lambda b: None, {**MODEL, "d": (3,)}),
    ("model-has-fewer", lambda b: None, {"a": (8, 12), "b": (10,)}),
    ("empty-model", lambda b: None, {}),
]


@pytest.mark.parametrize(
    ("mutate", "model"), [c[1:] for c in NAME_CASES], ids=[c[0] for c in NAME_CASES]
)
def test_names_must_match_the_model(mutate: Callable[[dict], Any], model: dict) -> None:
    assert reject(mutated(mutate), model).field == "body.tensors"


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
