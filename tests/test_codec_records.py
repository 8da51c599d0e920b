"""A payload's prefix and header read alone, its envelope unpacked and packed again, and records
shipped between ranks and assembled.

- ``payload_base`` needs only the prefix and the header; ``header_length`` checks the prefix
  (magic, version, flags) and the limit on the header's length;
- ``unpack_envelope`` / ``pack_envelope`` and ``read_record`` give back the payload's bytes;
- records shipped between ranks (``records_to_bytes``) come back equal, and bad ones are a
  ``PayloadError`` with the field; records encoded in disjoint sets and merged give ``encode``'s
  bytes exactly; ``pack_envelope`` refuses what no reader accepts.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import torch

from protocol.codec import assemble, encode_records, header_limit, payload_base
from protocol.envelope import (
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
from support.codec_inputs import bits
from support.partial_payload import (
    HEADER,
    NAMES,
    PAYLOAD,
    RECON,
    SHAPES,
    SPLIT,
    ZSTD_CODED,
    inputs,
)


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
    records, _ = encode_records(inputs(), topk=64, tile=64)
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
    x = inputs()
    mine = {n: x[n] for n in split}
    theirs = {n: x[n] for n in NAMES if n not in split}
    rec_a, recon_a = encode_records(mine, topk=64, tile=64)
    rec_b, recon_b = encode_records(theirs, topk=64, tile=64)
    shipped = records_from_bytes(records_to_bytes(rec_b))  # from another rank
    assert assemble(shipped + rec_a, topk=64, tile=64, **HEADER) == PAYLOAD
    merged = tuple(sorted(rec_a + shipped, key=lambda r: r.name))
    env = Envelope(HEADER["run_id"], 5, HEADER["node_id"], HEADER["base"], 64, 64, 0, 0, merged)
    assert pack_envelope(env) == PAYLOAD
    for name, t in {**recon_a, **recon_b}.items():
        assert torch.equal(bits(t), bits(RECON[name]))


def test_pack_envelope_refuses_what_no_reader_accepts() -> None:
    records, _ = encode_records(inputs(), topk=64, tile=64)
    for bad in (records[::-1], [records[0], records[0]]):
        with pytest.raises(CodecError):
            pack_envelope(Envelope("", 0, "", "", 64, 64, 0, 0, tuple(bad)))
    short = TensorRecord("x", (1,), 0, b"\x00" * 19, b"\x00", b"\x80", b"")
    with pytest.raises(CodecError):
        pack_envelope(Envelope("", 0, "", "", 64, 64, 0, 0, (short,)))
    with pytest.raises(CodecError):
        assemble(records + records[:1], topk=64, tile=64)
