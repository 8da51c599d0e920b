"""Partial reads of a payload, and payloads assembled from records encoded apart.

A node of several processes gives each rank some of the model's tensors: each rank encodes its
own records (rank 0 assembles the payload) and reads only its own tensors' records of a peer's
payload, from memory, a file or by byte ranges. These tests pin that:

- a corrupt record X fails the readers that read X and no other; every header-level fault (a
  declared length, the total size, the header's CRC, order, names, shapes) fails every reader,
  whatever it reads, with the same field;
- ``read_payload_file`` and ``read_payload_ranges`` give what ``read_payload`` gives on the same
  bytes, reading only the prefix, the header and the chosen records, and decompressing only
  the chosen records' zstd frames of codes.

The payload they read is ``support.partial_payload``'s; its prefix, header and envelope alone,
and records shipped between ranks and assembled, are ``test_codec_records.py``'s.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol import envelope
from protocol.codec import (
    decode,
    header_limit,
    read_payload,
    read_payload_file,
    read_payload_ranges,
)
from protocol.envelope import (
    PREFIX,
    read_index,
)
from protocol.errors import PayloadError
from support import reference_codec as ref
from support.codec_inputs import bits
from support.partial_payload import (
    HEADER,
    NAMES,
    PAYLOAD,
    RECON,
    SHAPES,
    SPLIT,
    ZSTD_CODED,
    assert_same,
)


def _only_sets() -> list[list[str]]:
    return [[], *([n] for n in NAMES), NAMES[::2], NAMES]


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
        assert_same(got, want)


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
    assert_same(got, read_payload(PAYLOAD, SHAPES, only=only))
    a, b, c = (index.entry(n) for n in only)
    assert index.ranges(only) == [(a.offset, b.offset + b.size), (c.offset, c.offset + c.size)]
    assert fetched == [(0, 14), (14, index.data_start), *index.ranges(only)]


def test_a_short_fetch_is_a_payload_error() -> None:
    with pytest.raises(PayloadError) as err:
        read_payload_ranges(lambda a, b: PAYLOAD[a : b - 1], len(PAYLOAD), SHAPES)
    assert err.value.field == "size"
