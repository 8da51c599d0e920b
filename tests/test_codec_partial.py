"""Partial reads of a payload, and payloads assembled from records encoded apart.

A node of several processes gives each rank some of the model's tensors: each rank encodes its
own records (rank 0 assembles the payload) and reads only its own tensors' records of a peer's
payload, from memory, a file or by byte ranges. These tests pin that:

- a corrupt record X fails the readers that read X and no other; every header-level fault (a
  declared length, the total size, the header's CRC, order, names, shapes) fails every reader,
  whatever it reads, with the same field;
- ``read_payload_file`` and ``read_payload_ranges`` give what ``read_payload`` gives on the same
  bytes, reading only the prefix, the header and the chosen records, and decompressing only
  the chosen records' zstd frames of codes;
- records shipped between ranks (``records_to_bytes``) come back equal, and bad ones are a
  ``PayloadError``; records encoded in disjoint sets and merged give ``encode``'s bytes exactly.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from protocol import envelope
from protocol.codec import (
    assemble,
    decode,
    encode,
    encode_records,
    header_limit,
    payload_base,
    read_payload,
    read_payload_file,
    read_payload_ranges,
)
from protocol.envelope import (
    PREFIX,
    Envelope,
    TensorRecord,
    header_length,
    pack_envelope,
    read_index,
    read_record,
    records_from_bytes,
    records_to_bytes,
    unpack_envelope,
)
from protocol.errors import CodecError, PayloadError
from support import reference_codec as ref
from support.codec_inputs import bits

SHAPES: dict[str, tuple[int, ...]] = {
    "emb": (96, 128),
    "head.bias": (130,),
    "layer.0.w": (64, 64),
    "layer.1.w": (3, 5, 7),
    "norm": (),
    "unused": (0, 4),
}
NAMES = sorted(SHAPES)
HEADER: dict[str, Any] = {"run_id": "run-p", "round": 5, "node_id": "node-3", "base": "ab" * 32}


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    # Half of "emb" is +-1: fewer distinct codes, so its record stores them as a zstd frame.
    out["emb"][:48] = out["emb"][:48].sign()
    return out


PAYLOAD, RECON = encode(_inputs(), **HEADER)
SPLIT = ref.split_payload(PAYLOAD)
#: The records whose codes are a zstd frame (the others' are raw).
ZSTD_CODED = [e[0] for e in SPLIT.header["tensors"] if e[ref.ZSTD]]


def _only_sets() -> list[list[str]]:
    return [[], *([n] for n in NAMES), NAMES[::2], NAMES]


def _assert_same(a: Any, b: Any) -> None:
    assert (a.run_id, a.round, a.node_id, a.base, a.tile, a.topk) == (
        b.run_id,
        b.round,
        b.node_id,
        b.base,
        b.tile,
        b.topk,
    )
    assert list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        x, y = a.tensors[name], b.tensors[name]
        assert torch.equal(x.index, y.index) and torch.equal(x.codes, y.codes)
        assert torch.equal(bits(x.table), bits(y.table))


def _field(fn: Any) -> str | None:
    try:
        fn()
    except PayloadError as err:
        return err.field
    return None


# ---- what a partial reader holds ----------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True])
def test_a_partial_read_holds_exactly_the_chosen_tensors(lazy: bool) -> None:
    whole = read_payload(PAYLOAD, SHAPES)
    for only in _only_sets():
        part = read_payload(PAYLOAD, SHAPES, only=only, lazy=lazy)
        assert list(part.tensors) == sorted(only)
        for name in only:
            got = part.tensors[name]
            assert torch.equal(bits(got.dense()), bits(RECON[name]))
            assert torch.equal(got.index, whole.tensors[name].index)
        assert (part.base, part.round, part.node_id) == (HEADER["base"], 5, "node-3")


def test_only_must_name_tensors_of_the_model() -> None:
    with pytest.raises(KeyError, match="nope"):
        read_payload(PAYLOAD, SHAPES, only=["emb", "nope"])
    with pytest.raises(TypeError):
        read_payload(PAYLOAD, SHAPES, only="emb")
    # A caller's mistake is reported before the payload is looked at, even a malformed one.
    with pytest.raises(KeyError):
        read_payload(b"junk", SHAPES, only=["nope"])


def test_the_payload_holds_both_forms_of_codes() -> None:
    assert ZSTD_CODED == ["emb"]


@pytest.mark.parametrize("lazy", [False, True])
def test_a_partial_read_decompresses_only_its_own_frames(
    lazy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zstd frame of codes is decompressed by the readers of its record only, and once."""
    seen: list[int] = []
    real = envelope.raw_codes

    def spy(frame: Any, size: int, field: str) -> bytes:
        seen.append(size)
        return real(frame, size, field)

    monkeypatch.setattr(envelope, "raw_codes", spy)
    emb = read_payload(PAYLOAD, SHAPES, only=["emb"]).tensors["emb"].geometry.n_kept
    for only in _only_sets():
        seen.clear()
        part = read_payload(PAYLOAD, SHAPES, only=only, lazy=lazy)
        for name in part.tensors:  # a lazy lookup decodes: no second decompression
            assert part.tensors[name].codes.numel() == part.tensors[name].geometry.n_kept
        assert seen == ([(emb + 3) // 4] if "emb" in only else [])


# ---- record-level faults fail only their readers ------------------------------------------


def _corrupt_record(name: str, *, fix_crc: bool) -> bytes:
    """``PAYLOAD`` with the first codes byte of ``name`` given its padding or a flipped bit."""
    i = NAMES.index(name)
    records = list(SPLIT.records)
    codes, unary, rem = records[i]
    if fix_crc:  # a deep fault behind a matching CRC: the last codes byte's padding bits set
        n_kept = read_payload(PAYLOAD, SHAPES, only=[name]).tensors[name].geometry.n_kept
        assert n_kept % 4, "needs padding bits in the last codes byte"
        records[i] = (codes[:-1] + bytes([codes[-1] | 1]), unary, rem)
        return ref.build_payload(SPLIT.header, records)
    flipped = bytearray(PAYLOAD)
    flipped[SPLIT.offsets[i]] ^= 0x10
    return bytes(flipped)


@pytest.mark.parametrize("name", ["layer.1.w", "norm"])
def test_a_deep_record_fault_fails_its_readers_only(name: str) -> None:
    _check_record_fault(_corrupt_record(name, fix_crc=True), name, "codes")


@pytest.mark.parametrize(
    "frame",
    [
        lambda f: f + b"\x00",  # a byte after the frame
        lambda f: f[:4] + b"\x00" + f[5:],  # a reserved frame header bit pattern
        lambda f: f[:-1],  # truncated
    ],
    ids=["trailing-byte", "bad-descriptor", "truncated"],
)
def test_a_bad_zstd_frame_fails_its_readers_only(frame: Any) -> None:
    """Behind a matching length and CRC: only the readers that decompress it find the fault."""
    _check_record_fault(_with_record("emb", codes=frame(SPLIT.records[0][0])), "emb", "codes")


@pytest.mark.parametrize("name", [n for n in NAMES if n != "unused"])
def test_a_corrupt_record_fails_its_readers_only(name: str) -> None:
    _check_record_fault(_corrupt_record(name, fix_crc=False), name, "crc32")


def _check_record_fault(data: bytes, name: str, part: str) -> None:
    field = f"tensors[{NAMES.index(name)}].{part}"
    for only in _only_sets():
        for lazy in (False, True):
            got = _field(lambda: read_payload(data, SHAPES, only=only, lazy=lazy))  # noqa: B023
            assert got == (field if name in only else None), (only, lazy, got)
    assert _field(lambda: read_payload(data, SHAPES)) == field
    assert _field(lambda: decode(data, SHAPES)) == field


# ---- header-level faults fail every reader ------------------------------------------------


def _entry_change(name: str, at: int | slice, value: Any) -> bytes:
    header = copy.deepcopy(SPLIT.header)
    header["tensors"][NAMES.index(name)][at] = value
    return ref.build_payload(header, SPLIT.records, sync=False)


def _with_record(name: str, **sections: bytes) -> bytes:
    i = NAMES.index(name)
    parts = dict(zip(ref.SECTIONS, SPLIT.records[i], strict=True))
    parts.update(sections)
    records = list(SPLIT.records)
    records[i] = (parts["codes"], parts["unary"], parts["remainders"])
    return ref.build_payload(SPLIT.header, records)


def _swapped() -> bytes:
    header = copy.deepcopy(SPLIT.header)
    t = header["tensors"]
    t[1], t[2] = t[2], t[1]
    return ref.build_payload(header, [SPLIT.records[i] for i in (0, 2, 1, 3, 4, 5)])


def _header_faults() -> list[tuple[str, bytes, str]]:
    i = NAMES.index("layer.1.w")
    codes, unary, rem = SPLIT.records[i]
    last = NAMES.index("norm")
    emb = SPLIT.header["tensors"][0]
    empty = NAMES.index("unused")
    flag = ref.ZSTD
    return [
        ("zstd-flag-on-raw-codes", _entry_change("layer.1.w", flag, 1), f"tensors[{i}].codes"),
        ("raw-flag-on-a-frame", _entry_change("emb", flag, 0), "tensors[0].codes"),
        ("zstd-flag-on-no-codes", _entry_change("unused", flag, 1), f"tensors[{empty}].codes"),
        ("flag-2", _entry_change("norm", flag, 2), f"tensors[{last}].codes_zstd"),
        ("no-flag", _entry_change("norm", slice(flag, None), []), f"tensors[{last}]"),
        ("codes-one-more", _with_record("layer.1.w", codes=codes + b"\x00"), f"tensors[{i}].codes"),
        ("codes-one-less", _with_record("layer.1.w", codes=codes[:-1]), f"tensors[{i}].codes"),
        (
            "rem-one-more",
            _with_record("layer.1.w", remainders=rem + b"\x00"),
            f"tensors[{i}].remainders",
        ),
        ("unary-empty", _with_record("layer.1.w", unary=b""), f"tensors[{i}].unary"),
        (
            "unary-over-bound",
            _with_record("layer.1.w", unary=unary + bytes(500)),
            f"tensors[{i}].unary",
        ),
        ("rice-bits-21", _entry_change("layer.1.w", 2, 21), f"tensors[{i}].rice_bits"),
        ("stats-short", _entry_change("norm", 3, b"\x00" * 19), f"tensors[{last}].stats"),
        ("declared-one-more", _entry_change("emb", 5, emb[5] + 1), "size"),  # within the bound
        ("trailing-byte", PAYLOAD + b"\x00", "size"),
        ("truncated", PAYLOAD[:-1], "size"),
        ("header-crc", PAYLOAD[:10] + bytes(4) + PAYLOAD[14:], "header.crc32"),
        ("order", _swapped(), "header.tensors"),
        ("renamed", _entry_change("norm", 0, "norn"), "header.tensors"),
        ("shape", _entry_change("emb", 1, [128, 96]), "tensors[0].shape"),
        ("version-1", PAYLOAD[:4] + b"\x01" + PAYLOAD[5:], "header.version"),
    ]


HEADER_FAULTS = _header_faults()


@pytest.mark.parametrize(
    ("data", "field"), [c[1:] for c in HEADER_FAULTS], ids=[c[0] for c in HEADER_FAULTS]
)
def test_a_header_level_fault_fails_every_reader(data: bytes, field: str, tmp_path: Path) -> None:
    path = tmp_path / "p.slc"
    path.write_bytes(data)
    for only in [None, *_only_sets()]:
        for lazy in (False, True):
            assert _field(lambda: read_payload(data, SHAPES, only=only, lazy=lazy)) == field  # noqa: B023
            assert _field(lambda: read_payload_file(path, SHAPES, only=only, lazy=lazy)) == field  # noqa: B023


def test_a_model_with_other_shapes_fails_every_reader() -> None:
    other = {**SHAPES, "norm": (1,)}
    for only in _only_sets():
        assert _field(lambda: read_payload(PAYLOAD, other, only=only)) == "tensors[4].shape"  # noqa: B023


# ---- files and byte ranges ----------------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True])
def test_read_payload_file_equals_read_payload(lazy: bool, tmp_path: Path) -> None:
    path = tmp_path / "peer.slc"
    path.write_bytes(PAYLOAD)
    for only in [None, *_only_sets()]:
        want = read_payload(PAYLOAD, SHAPES, only=only, lazy=lazy, topk=64, tile=64)
        got = read_payload_file(str(path), SHAPES, only=only, lazy=lazy, topk=64, tile=64)
        _assert_same(got, want)


def test_read_payload_file_reads_only_the_needed_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "peer.slc"
    path.write_bytes(PAYLOAD)
    calls: list[tuple[int, int]] = []
    real = os.pread

    def spy(fd: int, n: int, offset: int) -> bytes:
        calls.append((offset, n))
        return real(fd, n, offset)

    monkeypatch.setattr(os, "pread", spy)
    index = read_index(PAYLOAD, max_header=header_limit(SHAPES))
    for only in _only_sets():
        calls.clear()
        read_payload_file(path, SHAPES, only=only)
        records = sum(index.entry(n).size for n in only)
        assert sum(n for _, n in calls) == index.data_start + records
        assert calls[:2] == [(0, PREFIX.size), (PREFIX.size, index.data_start - PREFIX.size)]
        assert len(calls) == 2 + len(index.ranges(only))


def test_a_file_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "peer.slc"
    for data in (PAYLOAD[:-1], PAYLOAD + b"\x00", PAYLOAD[:20]):
        path.write_bytes(data)
        with pytest.raises(PayloadError) as err:
            read_payload_file(path, SHAPES, only=[])
        assert err.value.field in ("size", "header")


def test_read_payload_ranges_fetches_merged_ranges() -> None:
    fetched: list[tuple[int, int]] = []

    def fetch(start: int, stop: int) -> bytes:
        fetched.append((start, stop))
        return PAYLOAD[start:stop]

    index = read_index(PAYLOAD, max_header=header_limit(SHAPES))
    only = ["head.bias", "layer.0.w", "norm"]  # the first two are adjacent: one range
    got = read_payload_ranges(fetch, len(PAYLOAD), SHAPES, only=only)
    _assert_same(got, read_payload(PAYLOAD, SHAPES, only=only))
    a, b, c = (index.entry(n) for n in only)
    assert index.ranges(only) == [(a.offset, b.offset + b.size), (c.offset, c.offset + c.size)]
    assert fetched == [(0, 14), (14, index.data_start), *index.ranges(only)]


def test_a_short_fetch_is_a_payload_error() -> None:
    with pytest.raises(PayloadError) as err:
        read_payload_ranges(lambda a, b: PAYLOAD[a : b - 1], len(PAYLOAD), SHAPES)
    assert err.value.field == "size"


def test_payload_base_needs_only_the_prefix_and_the_header() -> None:
    index = read_index(PAYLOAD, max_header=header_limit(SHAPES))
    assert payload_base(PAYLOAD, SHAPES) == HEADER["base"]
    assert payload_base(PAYLOAD[: index.data_start], SHAPES) == HEADER["base"]
    with pytest.raises(PayloadError) as err:
        payload_base(PAYLOAD[: index.data_start - 1], SHAPES)
    assert err.value.field == "header"


@pytest.mark.parametrize(
    ("prefix", "field"),
    [
        (b"", "header"),
        (PAYLOAD[:13], "header"),
        (b"SLCQ" + PAYLOAD[4:14], "header.magic"),
        (PAYLOAD[:4] + b"\x01" + PAYLOAD[5:14], "header.version"),
        (PAYLOAD[:5] + b"\x02" + PAYLOAD[6:14], "header.flags"),
        (None, "payload"),
    ],
)
def test_header_length_checks_the_prefix(prefix: Any, field: str) -> None:
    with pytest.raises(PayloadError) as err:
        header_length(prefix)
    assert err.value.field == field


def test_header_length_and_the_limit() -> None:
    length = header_length(PAYLOAD[:14])
    assert length == SPLIT.header_length
    assert header_length(PAYLOAD, max_header=length) == length
    with pytest.raises(PayloadError) as err:
        header_length(PAYLOAD, max_header=length - 1)
    assert err.value.field == "header.length"


def test_unpack_envelope_and_read_record_round_trip() -> None:
    limit = header_limit(SHAPES)
    env = unpack_envelope(PAYLOAD, max_header=limit)
    assert pack_envelope(env) == PAYLOAD
    index = read_index(PAYLOAD, max_header=limit)
    for entry, rec in zip(index.entries, env.tensors, strict=True):
        blob = PAYLOAD[entry.offset : entry.offset + entry.size]
        assert read_record(entry, blob) == rec
        with pytest.raises(PayloadError) as err:
            read_record(entry, blob + b"\x00")
        assert err.value.field == entry.field
    with pytest.raises(PayloadError) as err:
        unpack_envelope(PAYLOAD + b"\x00", max_header=limit)
    assert err.value.field == "size"


# ---- records between ranks, and assembly --------------------------------------------------


def test_records_to_bytes_round_trip() -> None:
    records, _ = encode_records(_inputs(), topk=64, tile=64)
    assert [r.name for r in records if r.codes_zstd] == ZSTD_CODED  # shipped as stored
    assert records_from_bytes(records_to_bytes(records)) == records
    assert records_from_bytes(records_to_bytes([])) == []
    assert records_from_bytes(bytearray(records_to_bytes(records[:1]))) == records[:1]


def _row(**changes: Any) -> list:
    row: list[Any] = ["w", [4, 4], 0, b"\x00" * 20, b"", b"", b"", 0]
    fields = ["name", "shape", "rice_bits", "stats", "codes", "unary", "rem", "codes_zstd"]
    for at, value in changes.items():
        row[fields.index(at)] = value
    return row


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (b"", "records"),
        (b"\xc1", "records"),
        (b"\x90\x00", "records"),  # trailing bytes
        (None, "records"),
        (msgpack.packb({"a": 1}), "records"),
        (msgpack.packb([1]), "records[0]"),
        (msgpack.packb([_row()[:7]]), "records[0]"),
        (msgpack.packb([[*_row(), b""]]), "records[0]"),
        (msgpack.packb([_row(name=1)]), "records[0].name"),
        (msgpack.packb([_row(name="n" * 257)]), "records[0].name"),
        (msgpack.packb([_row(shape=[-1])]), "records[0].shape"),
        (msgpack.packb([_row(shape=[1] * 9)]), "records[0].shape"),
        (msgpack.packb([_row(rice_bits=65)]), "records[0].rice_bits"),
        (msgpack.packb([_row(stats=b"\x00")], use_bin_type=True), "records[0].stats"),
        (msgpack.packb([_row(codes="text")], use_bin_type=True), "records[0].codes"),
        (msgpack.packb([_row(), _row(unary=None)], use_bin_type=True), "records[1].unary"),
        (msgpack.packb([_row(rem=[1])], use_bin_type=True), "records[0].remainders"),
        (msgpack.packb([_row(codes_zstd=2)], use_bin_type=True), "records[0].codes_zstd"),
        (msgpack.packb([_row(codes_zstd=True)], use_bin_type=True), "records[0].codes_zstd"),
        (msgpack.packb([_row(codes_zstd=None)], use_bin_type=True), "records[0].codes_zstd"),
    ],
)
def test_records_from_bytes_rejects_bad_input(data: Any, field: str) -> None:
    with pytest.raises(PayloadError) as err:
        records_from_bytes(data)
    assert err.value.field == field


@pytest.mark.parametrize(
    "split", [["emb", "norm"], ["head.bias"], [], NAMES], ids=["two", "one", "none", "all"]
)
def test_records_encoded_apart_assemble_to_encodes_bytes(split: list[str]) -> None:
    x = _inputs()
    mine = {n: x[n] for n in split}
    theirs = {n: x[n] for n in NAMES if n not in split}
    rec_a, recon_a = encode_records(mine, topk=64, tile=64)
    rec_b, recon_b = encode_records(theirs, topk=64, tile=64)
    shipped = records_from_bytes(records_to_bytes(rec_b))  # from another rank
    assert assemble(shipped + rec_a, topk=64, tile=64, **HEADER) == PAYLOAD
    merged = tuple(sorted(rec_a + shipped, key=lambda r: r.name))
    env = Envelope(HEADER["run_id"], 5, HEADER["node_id"], HEADER["base"], 64, 64, merged)
    assert pack_envelope(env) == PAYLOAD
    for name, t in {**recon_a, **recon_b}.items():
        assert torch.equal(bits(t), bits(RECON[name]))


def test_pack_envelope_refuses_what_no_reader_accepts() -> None:
    records, _ = encode_records(_inputs(), topk=64, tile=64)
    for bad in (records[::-1], [records[0], records[0]]):
        with pytest.raises(CodecError):
            pack_envelope(Envelope("", 0, "", "", 64, 64, tuple(bad)))
    short = TensorRecord("x", (1,), 0, b"\x00" * 19, b"\x00", b"\x80", b"")
    with pytest.raises(CodecError):
        pack_envelope(Envelope("", 0, "", "", 64, 64, (short,)))
    with pytest.raises(CodecError):
        assemble(records + records[:1], topk=64, tile=64)
