"""The codec's header fields and wire layout (format version 2), read with the independent
reader in ``support.reference_codec``: every header field round-trips at its limits, the prefix,
header and records lie exactly where FORMAT.md puts them, each record (shape, statistics, packed
codes stored raw or as a zstd frame, whichever is shorter, Rice-coded positions) is exactly what
the spec says, the independent writer rebuilds the same bytes, and the reconstruction decoded
from the bytes, by us and by the reference, is the encoder's bit for bit.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from protocol.codec import decode, encode, read_payload
from protocol.errors import PayloadError
from support import reference_codec as ref

# ---- header fields --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        {"run_id": "", "round": 0, "node_id": "", "base": ""},
        {"run_id": "run-1", "round": 12345, "node_id": "node-α✓", "base": "ab" * 32, "steps": 7},
        {
            "run_id": "r" * 256,
            "round": 2**63 - 1,
            "node_id": "n" * 256,
            "base": "b" * 256,
            "steps": 2**32 - 1,
            "tokens": 2**63 - 1,
        },
        {"run_id": "😀" * 256, "round": 1, "node_id": "😀" * 256, "base": "😀" * 256},
    ],
    ids=["empty", "typical", "limits", "4-byte-utf8-limits"],
)
@pytest.mark.parametrize(("topk", "tile"), [(64, 64), (5, 8), (1, 1)])
def test_header_fields_round_trip(header: dict, topk: int, tile: int) -> None:
    x = {"w": torch.randn(16, 24, generator=torch.Generator().manual_seed(1))}
    payload, _ = encode(x, topk=topk, tile=tile, **header)
    p = read_payload(payload, {"w": (16, 24)})
    assert (p.run_id, p.round, p.node_id, p.base) == (
        header["run_id"],
        header["round"],
        header["node_id"],
        header["base"],
    )
    assert (p.steps, p.tokens) == (header.get("steps", 0), header.get("tokens", 0))
    assert (p.topk, p.tile) == (topk, tile)
    assert read_payload(payload, {"w": (16, 24)}, topk=topk, tile=tile).topk == topk
    # A run's topk bounds the payload's from above: a sparser payload is read, a denser refused.
    assert read_payload(payload, {"w": (16, 24)}, topk=topk + 1).topk == topk
    if topk > 1:
        with pytest.raises(PayloadError) as err:
            read_payload(payload, {"w": (16, 24)}, topk=topk - 1)
        assert err.value.field == "header.topk"
    with pytest.raises(PayloadError) as err:
        read_payload(payload, {"w": (16, 24)}, tile=tile + 1)
    assert err.value.field == "header.tile"


def test_longest_names_fit_the_header_limit() -> None:
    """256-character names of 4-byte UTF-8 characters in 8 dimensions, with the longest header
    strings: the largest valid header still fits the limit derived from the model."""
    names = [c * 256 for c in "😀😁😂"]
    x = {n: torch.randn((1,) * 7 + (3,)) for n in names}
    model = {n: tuple(t.shape) for n, t in x.items()}
    big = "😀" * 256
    payload, recon = encode(x, run_id=big, node_id=big, base=big, round=2**63 - 1)
    out = decode(payload, model)
    assert all(torch.equal(out[n], recon[n]) for n in names)


# ---- the wire layout, read independently ----------------------------------------------------

CASES: list[tuple[dict[str, Any], int, int]] = [
    ({"w": (64, 64), "b": (100,)}, 64, 64),
    ({"t": (3, 5, 7), "s": ()}, 5, 8),
    ({"m": (96, 130)}, 128, 64),  # codes stored as a zstd frame
    ({"one": torch.ones(64, 64), "e": (0, 3)}, 64, 64),  # zero gaps, equal codes; no codes
    ({"w": (256, 512), "b": (512,)}, 64, 64),  # a zstd frame and raw codes
]


def _inputs(tensors: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        n: v if isinstance(v, torch.Tensor) else torch.randn(v, generator=g)
        for n, v in tensors.items()
    }


@pytest.mark.parametrize(("tensors", "topk", "tile"), CASES)
def test_wire_layout_matches_the_spec(tensors: dict, topk: int, tile: int) -> None:
    xs = _inputs(tensors)
    payload, _ = encode(xs, topk=topk, tile=tile, run_id="r", round=3, node_id="n", base="f")
    # The prefix: magic, version 3, flags 0, L, CRC-32 of the L header bytes.
    magic, version, flags, length, crc = struct.unpack_from("<4sBBII", payload)
    assert (magic, version, flags) == (b"SLCP", 3, 0)
    assert crc == zlib.crc32(payload[14 : 14 + length])
    split = ref.split_payload(payload)  # asserts offsets, CRCs and the exact total size
    header = split.header
    assert set(header) == {
        "run", "round", "node", "base", "tile", "topk", "steps", "tokens", "tensors"
    }  # fmt: skip
    assert (header["run"], header["round"], header["node"], header["base"]) == ("r", 3, "n", "f")
    assert (header["tile"], header["topk"]) == (tile, topk)
    assert [e[0] for e in header["tensors"]] == sorted(xs)
    # Records lie back to back from 14 + L, in header order.
    at = 14 + length
    for entry, offset in zip(header["tensors"], split.offsets, strict=True):
        assert offset == at
        at += sum(entry[4:7])
    assert at == len(payload)
    model = {n: tuple(x.shape) for n, x in xs.items()}
    sparse = read_payload(payload, model)
    for entry, record in zip(header["tensors"], split.records, strict=True):
        name, shape, b, stats, codes_len, unary_len, rem_len, record_crc, codes_zstd = entry
        stored, unary, rem = record
        assert (len(stored), len(unary), len(rem)) == (codes_len, unary_len, rem_len)
        assert record_crc == zlib.crc32(stored + unary + rem)  # the codes as stored
        st_ = sparse.tensors[name]
        geo = st_.geometry
        assert shape == list(xs[name].shape)
        assert len(stats) == 20
        # The codes: packed as the spec says, stored in the shorter form (raw on ties).
        raw = ref.pack_codes([int(c) for c in st_.codes.tolist()])
        assert len(raw) == (geo.n_kept + 3) // 4
        assert ref.raw_codes(stored, codes_zstd, len(raw)) == raw
        assert (stored, codes_zstd) == ref.store_codes(raw)
        assert codes_len < len(raw) if codes_zstd else codes_len == len(raw)
        assert rem_len == (geo.n_kept * b + 7) // 8
        positions = st_.positions.tolist()
        assert ref.decode_positions(b, unary, rem, n_tiles=geo.n_tiles, k=geo.k) == positions
        gaps = ref.gaps_of(positions)
        assert (unary, rem) == ref.rice_streams(gaps, b)
        if gaps:  # the Rice parameter minimises the coded size (the smallest b on ties)
            costs = [sum(g_ >> c for g_ in gaps) + len(gaps) * (c + 1) for c in range(21)]
            assert b == costs.index(min(costs))
    # The independent writer rebuilds the same bytes from the parts.
    assert ref.build_payload(header, split.records) == payload


def _ref_reconstruction(payload: bytes, model: dict, topk: int, tile: int) -> dict:
    """The dense reconstruction, from the bytes, by the reference alone."""
    split = ref.split_payload(payload)
    out = {}
    for entry, (stored, unary, rem) in zip(split.header["tensors"], split.records, strict=True):
        name, b, stats = entry[0], entry[2], entry[3]
        g = ref.geometry(model[name], topk=topk, tile=tile)
        shift, *levels = struct.unpack("<5f", stats)
        table = [float(np.float32(lv) + np.float32(shift)) for lv in levels]
        codes = ref.raw_codes(stored, entry[ref.ZSTD], (g.n_tiles * g.k + 3) // 4)
        bits = ref.read_bits(codes)
        positions = ref.decode_positions(b, unary, rem, n_tiles=g.n_tiles, k=g.k)
        dense = [0.0] * (g.rows * g.cols)
        j = 0
        for idx, pos in zip(g.tile_flat_indices(), positions, strict=True):
            for p in pos:
                dense[idx[p]] = table[bits[2 * j] * 2 + bits[2 * j + 1]]
                j += 1
        out[name] = torch.tensor(dense, dtype=torch.float32).reshape(model[name])
    return out


@pytest.mark.parametrize(("tensors", "topk", "tile"), CASES)
def test_decoding_the_bytes_is_the_encoders_reconstruction(
    tensors: dict, topk: int, tile: int
) -> None:
    xs = _inputs(tensors)
    model = {n: tuple(x.shape) for n, x in xs.items()}
    payload, recon = encode(xs, topk=topk, tile=tile)
    ours = decode(payload, model)
    theirs = _ref_reconstruction(payload, model, topk, tile)
    for name in model:
        want = recon[name].contiguous().view(torch.int32)
        assert torch.equal(ours[name].contiguous().view(torch.int32), want)
        assert torch.equal(theirs[name].contiguous().view(torch.int32), want)


def test_both_forms_of_codes_appear_and_a_frame_only_where_shorter() -> None:
    """Per record, the writer's choice: the CASES hold both forms, and storing every record's
    codes raw instead (FORMAT.md: a writer may) gives a payload that decodes the same, its
    records larger by exactly what the frames saved."""
    forms = set()
    for tensors, topk, tile in CASES:
        xs = _inputs(tensors)
        payload, recon = encode(xs, topk=topk, tile=tile)
        split = ref.split_payload(payload)
        forms |= {e[ref.ZSTD] for e in split.header["tensors"]}
        plain = ref.with_raw_codes(payload, topk=topk, tile=tile)
        raw = ref.split_payload(plain)
        for entry, stored, plain_entry, codes in zip(
            split.header["tensors"], split.records, raw.header["tensors"], raw.records, strict=True
        ):
            assert plain_entry[ref.ZSTD] == 0
            assert (len(codes[0]) > len(stored[0])) == bool(entry[ref.ZSTD])
            assert codes[1:] == stored[1:]
        out = decode(plain, {n: tuple(x.shape) for n, x in xs.items()})
        assert all(torch.equal(out[n], recon[n]) for n in xs)
    assert forms == {0, 1}


def test_header_keys_may_come_in_any_order() -> None:
    """FORMAT.md: a map with exactly those keys; their order in the map is not part of it."""
    xs = _inputs({"w": (64, 64), "b": (100,)})
    payload, recon = encode(xs, run_id="r", round=3)
    split = ref.split_payload(payload)
    shuffled = dict(reversed(split.header.items()))
    other = ref.build_payload(shuffled, split.records)
    assert other != payload
    out = decode(other, {"w": (64, 64), "b": (100,)})
    assert all(torch.equal(out[n], recon[n]) for n in xs)


def test_the_header_is_one_msgpack_map_of_exactly_l_bytes() -> None:
    xs = _inputs({"w": (64, 64)})
    payload, _ = encode(xs)
    split = ref.split_payload(payload)
    raw = payload[14 : 14 + split.header_length]
    assert msgpack.unpackb(raw, raw=False) == split.header
    data = payload[14 + split.header_length :]
    # One more byte inside the header (the CRC and L made to match) is not one document.
    assert_rejected(ref.wrap_header(raw + b"\xc0", data), "header")


def assert_rejected(data: bytes, field: str) -> None:
    with pytest.raises(PayloadError) as err:
        read_payload(data, {"w": (64, 64)})
    assert err.value.field == field
