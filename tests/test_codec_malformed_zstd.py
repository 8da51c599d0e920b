"""Malformed codes stored as a zstd frame inside a tensor record: frames that are not ours
(other frame headers, skippable frames, dictionaries, checksums, sizes), flags that disagree
with the record's lengths, and random frames and corruptions behind valid checksums.

Every fault must raise PayloadError naming the field, and nothing else, in every reader; any
writer's valid frame (or the raw codes) decodes exactly. The rest of a record's malformations
are ``test_codec_malformed_streams.py``'s.
"""

from __future__ import annotations

import struct
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from protocol.codec import read_payload
from protocol.errors import PayloadError
from support import reference_codec as ref
from support.malformed_fixtures import (
    FUZZ,
    ZSTD,
    ZSTD_AT,
    ZSTD_HEADER,
    ZSTD_MODEL,
    ZSTD_RAW,
    ZSTD_RAW_SIZE,
    ZSTD_RECORDS,
    check_valid_or_rejected,
    reject,
    with_stored_codes,
)

# ---- codes stored as a zstd frame -----------------------------------------------------------

W_CODES = f"tensors[{ZSTD_AT}].codes"
FRAME = ZSTD_RECORDS[ZSTD_AT][0]  # "w"'s codes as our writer stores them
FRAME_HEADER = 6  # magic, frame header descriptor (single segment), one byte of content size
SKIPPABLE = struct.pack("<II", 0x184D2A50, 4) + b"\x00" * 4  # a skippable frame of 4 bytes


def _zheader(change: Any) -> bytes:
    """``ZSTD`` with a copy of its header changed by ``change(header)``, records as they are."""
    header = {**ZSTD_HEADER, "tensors": [list(e) for e in ZSTD_HEADER["tensors"]]}
    change(header)
    return ref.build_payload(header, ZSTD_RECORDS, sync=False)


def _reframed(descriptor: int, extra: bytes) -> bytes:
    """``FRAME`` with another frame header descriptor and ``extra`` fields after it (a window
    descriptor, a dictionary id, a content size), the blocks unchanged."""
    assert FRAME[4] == 0x20  # single segment, a one-byte content size: what ours are
    return FRAME[:4] + bytes([descriptor]) + extra + FRAME[FRAME_HEADER:]


def _zstd_faults() -> list[tuple[str, bytes]]:
    padded = ZSTD_RAW[:-1] + bytes([ZSTD_RAW[-1] | 0x01])  # 350 codes: 2 slots of padding
    with_sum = ref.zstd_frame(ZSTD_RAW, checksum=True)
    return [
        ("empty", b""),
        ("not-a-frame", ZSTD_RAW[:60]),
        ("skippable-frame", SKIPPABLE),
        ("skippable-then-frame", SKIPPABLE + ref.zstd_frame(b"\x00" * ZSTD_RAW_SIZE)),
        ("magic-only", FRAME[:4]),
        ("header-only", FRAME[:FRAME_HEADER]),
        ("truncated", FRAME[:-1]),
        ("no-content-size", ref.zstd_frame(ZSTD_RAW, content_size=False)),
        ("declares-one-less", ref.zstd_frame(ZSTD_RAW[:-1])),
        ("declares-one-more", ref.zstd_frame(ZSTD_RAW + b"\x00")),
        ("declares-a-megabyte", ref.zstd_frame(bytes(1_000_000))),
        ("declared-size-edited-down", FRAME[:5] + bytes([FRAME[5] - 1]) + FRAME[6:]),
        ("declared-size-edited-up", FRAME[:5] + bytes([FRAME[5] + 1]) + FRAME[6:]),
        ("trailing-byte", FRAME + b"\x00"),
        ("trailing-skippable-frame", FRAME + struct.pack("<II", 0x184D2A50, 0)),
        ("a-second-frame", FRAME + ref.zstd_frame(b"")),
        ("bad-checksum", with_sum[:-4] + bytes(4)),
        ("dictionary-id", _reframed(0x21, b"\x07" + FRAME[5:6])),
        ("window-over-content", _reframed(0x80, b"\x00" + struct.pack("<I", ZSTD_RAW_SIZE))),
        ("padding-bit-set", ref.zstd_frame(padded)),
        ("padding-bits-set", ref.zstd_frame(ZSTD_RAW[:-1] + bytes([ZSTD_RAW[-1] | 0x0F]))),
    ]


@pytest.mark.parametrize(
    ("stored"), [c[1] for c in _zstd_faults()], ids=[c[0] for c in _zstd_faults()]
)
def test_bad_zstd_frames(stored: bytes) -> None:
    """Each is behind a matching length (shorter than the raw codes) and CRC, so the frame's
    own rules (FORMAT.md, "Codes as stored") catch it; the readers of "b" accept."""
    assert len(stored) < ZSTD_RAW_SIZE
    data = with_stored_codes(stored)
    assert reject(data, ZSTD_MODEL).field == W_CODES
    assert list(read_payload(data, ZSTD_MODEL, only=["b"]).tensors) == ["b"]


def _zstd_variants() -> list[tuple[str, bytes, int]]:
    return [
        ("as-written", FRAME, 1),
        ("raw", ZSTD_RAW, 0),
        ("level-19", ref.zstd_frame(ZSTD_RAW, level=19), 1),
        ("with-checksum", ref.zstd_frame(ZSTD_RAW, checksum=True), 1),
        ("dictionary-id-0", _reframed(0x21, b"\x00" + FRAME[5:6]), 1),
        ("four-byte-content-size", _reframed(0xA0, struct.pack("<I", ZSTD_RAW_SIZE)), 1),
    ]


@pytest.mark.parametrize(
    ("stored", "codes_zstd"),
    [c[1:] for c in _zstd_variants()],
    ids=[c[0] for c in _zstd_variants()],
)
def test_any_writers_frame_or_the_raw_codes_are_accepted(stored: bytes, codes_zstd: int) -> None:
    """The form and the frame's bytes are the writer's: raw codes, another level, a checksum,
    a longer content size field all decode to the same tensor."""
    want = read_payload(ZSTD, ZSTD_MODEL).tensors["w"]
    data = with_stored_codes(stored, codes_zstd)
    for lazy in (False, True):
        got = read_payload(data, ZSTD_MODEL, lazy=lazy).tensors["w"]
        assert torch.equal(got.codes, want.codes) and torch.equal(got.index, want.index)


@pytest.mark.parametrize(
    "value", [2, 255, -1, 2**64 - 1, True, False, 1.0, None, "1", b"\x01", [1]]
)
@pytest.mark.parametrize("at", [0, ZSTD_AT])
def test_bad_codes_zstd_flags(value: Any, at: int) -> None:
    def change(header: dict) -> None:
        header["tensors"][at][ref.ZSTD] = value

    assert reject(_zheader(change), ZSTD_MODEL).field == f"tensors[{at}].codes_zstd"


def test_lengths_that_disagree_with_the_form_fail_every_reader() -> None:
    """From the header alone: raw codes are exactly ceil(n_kept / 4) bytes, a frame fewer."""
    cases = [
        (with_stored_codes(FRAME, 0), W_CODES),  # a frame's length declared as raw codes
        (with_stored_codes(ZSTD_RAW, 1), W_CODES),  # raw codes' length declared as a frame
        (with_stored_codes(FRAME + bytes(ZSTD_RAW_SIZE - len(FRAME) + 1), 1), W_CODES),
        (with_stored_codes(ref.zstd_frame(ZSTD_RAW, level=1) + b"\x00" * 40, 1), W_CODES),
    ]

    def flag_b(header: dict) -> None:  # "b": 1 byte of raw codes; no frame is shorter
        header["tensors"][0][ref.ZSTD] = 1

    cases.append((_zheader(flag_b), "tensors[0].codes"))
    for data, field in cases:
        assert reject(data, ZSTD_MODEL).field == field
        with pytest.raises(PayloadError) as err:
            read_payload(data, ZSTD_MODEL, only=())
        assert err.value.field == field


# Bytes of few distinct values, so that most frames of 88 of them are shorter than 88 bytes;
# some leave the last byte's two padding slots (its low four bits) zero, some do not.
_CODE_BYTES = st.sampled_from([0x00, 0x50, 0xA0, 0x90, 0x55, 0xAA, 0x69, 0x96, 0xFF, 0x01])


@FUZZ
@given(
    content=st.lists(_CODE_BYTES, min_size=ZSTD_RAW_SIZE, max_size=ZSTD_RAW_SIZE).map(bytes),
    level=st.integers(1, 19),
)
def test_any_frame_of_the_right_size_decodes_exactly_or_is_rejected(
    content: bytes, level: int
) -> None:
    """A frame of any 88 bytes decodes to exactly those codes when their padding is zero, and
    is rejected otherwise (or is not shorter than the raw codes: then the header says so)."""
    frame = ref.zstd_frame(content, level=level)
    data = with_stored_codes(frame)
    if len(frame) >= ZSTD_RAW_SIZE or content[-1] & 0x0F:
        assert reject(data, ZSTD_MODEL).field == W_CODES
    else:
        codes = read_payload(data, ZSTD_MODEL).tensors["w"].codes
        assert codes.tolist() == [(byte >> s) & 3 for byte in content for s in (6, 4, 2, 0)][:350]


@FUZZ
@given(flips=st.lists(st.integers(0, 10**6), min_size=1, max_size=3))
def test_corrupt_frames_behind_valid_checksums_fail_or_decode_consistently(
    flips: list[int],
) -> None:
    stored = bytearray(FRAME)
    for f in flips:
        stored[(f // 8) % len(stored)] ^= 0x80 >> (f % 8)
    check_valid_or_rejected(with_stored_codes(bytes(stored)), ZSTD_MODEL)
