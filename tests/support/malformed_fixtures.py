"""Shared fixtures of the malformed-payload tests: a small valid payload and ways to break it.

The payload is taken apart by the independent reader (``support.reference_codec``) into its
header map and its records, and the helpers rebuild it with the independent writer behind
valid checksums, so the deeper validation runs: ``mutated`` changes the header (the lengths and
CRCs as the change left them), ``with_sections`` replaces a record's codes or streams (its
lengths and CRC made to match). The small payload's codes are all raw (too short for a zstd
frame to save anything); ``ZSTD`` is a payload with one record of each form, and
``with_stored_codes`` replaces its zstd-coded record's codes as stored.

``reject`` and ``check_valid_or_rejected`` read every input every way the node does: eager,
lazy, dense, and partially. A partial reader checks the header against the whole model but
only its own records, so the verdicts must agree like this: the header-only read (``only=()``)
fails exactly when every reader fails with the same field; otherwise each reader of a tensor
reaches that tensor's own verdict, and the whole read fails with the first failing tensor's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

from protocol.codec import decode, encode, read_payload
from protocol.errors import PayloadError
from support import reference_codec as ref

# A small model: "a" has 6 tiles of 4x4 keeping 4 each (24 kept, codes padded to 6 bytes),
# "b" 5 tiles of 2 keeping 1 (5 kept: the last codes byte has padding), "c" is a scalar.
MODEL = {"a": (8, 12), "b": (10,), "c": ()}
TOPK, TILE = 4, 4
FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def small_inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in MODEL.items()}


ENCODED, _ = encode(small_inputs(), topk=TOPK, tile=TILE, run_id="run", round=1, node_id="n")
_SPLIT = ref.split_payload(ENCODED)
HEADER: dict[str, Any] = _SPLIT.header
RECORDS: list[ref.Record] = _SPLIT.records
SMALL = ref.build_payload(HEADER, RECORDS)  # the independent writer's bytes: equal to ENCODED
# A constant input: zero gaps and equal codes, the most regular streams.
CONSTANT_MODEL: dict[str, tuple[int, ...]] = {"z": (64, 64)}
CONSTANT, _ = encode({"z": torch.ones(64, 64)}, topk=8, tile=16)
BIG_MODEL = {"w": (256, 512), "v": (512,)}
BIG, _ = encode(
    {n: torch.randn(s, generator=torch.Generator().manual_seed(9)) for n, s in BIG_MODEL.items()}
)
# Both forms of codes: "w" keeps 350 values (7 tiles of 64x50 keeping 50), 88 bytes of codes
# (the last with padding) that a zstd frame stores in about 78; "b"'s single byte stays raw.
ZSTD_MODEL: dict[str, tuple[int, ...]] = {"b": (10,), "w": (64, 350)}
_GEN = torch.Generator().manual_seed(9)
ZSTD, _ = encode({n: torch.randn(s, generator=_GEN) for n, s in ZSTD_MODEL.items()})
_ZSPLIT = ref.split_payload(ZSTD)
ZSTD_HEADER: dict[str, Any] = _ZSPLIT.header
ZSTD_RECORDS: list[ref.Record] = _ZSPLIT.records
ZSTD_AT = 1  # "w"'s place in the header: its entry's field is tensors[1]
ZSTD_RAW_SIZE = 88
#: "w"'s raw codes, read back by the independent reader.
ZSTD_RAW = ref.raw_codes(ZSTD_RECORDS[ZSTD_AT][0], 1, ZSTD_RAW_SIZE)


def _verdict(data: Any, model: dict, **kwargs: Any) -> str | None:
    """``None`` if ``read_payload`` accepts, else the field its PayloadError names."""
    try:
        read_payload(data, model, **kwargs)
    except PayloadError as err:
        assert isinstance(err, ValueError)
        assert isinstance(err.field, str) and err.field
        return err.field
    return None


def _check_partial_readers(data: Any, model: dict, whole: str | None, **kwargs: Any) -> None:
    """The partial readers' verdicts agree with the whole read's ``whole`` (module docstring)."""
    header = _verdict(data, model, only=(), **kwargs)
    names = sorted(model)
    singles = [_verdict(data, model, only=[n], **kwargs) for n in names]
    if header is not None:
        assert whole == header, (whole, header)
        assert all(s == header for s in singles), (header, singles)
        return
    for i, field in enumerate(singles):
        assert field is None or field.startswith(f"tensors[{i}]"), (i, field)
    first = next((s for s in singles if s is not None), None)
    assert whole == first, (whole, singles)


def reject(data: Any, model: dict = MODEL, **kwargs: Any) -> PayloadError:
    """Decode ``data`` every way (eager, lazy as the node reads, dense, partially); each must
    raise PayloadError, the lazy check naming the same field as the eager decode, the partial
    readers agreeing (module docstring); returns the eager decode's error."""
    with pytest.raises(PayloadError) as err:
        read_payload(data, model, **kwargs)
    assert isinstance(err.value, ValueError)
    assert isinstance(err.value.field, str) and err.value.field
    with pytest.raises(PayloadError) as lazy:
        read_payload(data, model, lazy=True, **kwargs)
    assert lazy.value.field == err.value.field
    with pytest.raises(PayloadError):
        decode(data, model)
    _check_partial_readers(data, model, err.value.field, **kwargs)
    return err.value


def check_valid_or_rejected(data: bytes, model: dict = MODEL) -> None:
    """``data`` either raises PayloadError or decodes to a self-consistent payload; the lazy
    check (the node's path) and the partial readers reach the agreeing verdicts."""
    lazy_field = _verdict(data, model, lazy=True)
    try:
        payload = read_payload(data, model)
    except PayloadError as err:
        assert isinstance(err.field, str) and err.field
        assert lazy_field == err.field
        _check_partial_readers(data, model, err.field)
        return
    assert lazy_field is None
    _check_partial_readers(data, model, None)
    assert list(payload.tensors) == sorted(model)
    for name, t in payload.tensors.items():
        geo = t.geometry
        pos = t.positions.long()
        assert pos.shape == (geo.n_tiles, geo.k)
        if pos.numel():
            assert int(pos.min()) >= 0 and int(pos.max()) < geo.tile_len
            assert bool((pos[:, 1:] > pos[:, :-1]).all())
        assert t.codes.numel() == geo.n_kept
        assert t.codes.numel() == 0 or int(t.codes.max()) <= 3
        assert bool(torch.isfinite(t.table).all())
        dense = decode(data, model)[name]
        assert dense.shape == model[name] and bool(torch.isfinite(dense).all())


def mutated(fn: Callable[[dict], Any]) -> bytes:
    """The small payload with a copy of its header changed in place by ``fn``; the records,
    and the lengths and CRCs in the header, as ``fn`` left them."""
    header = copy.deepcopy(HEADER)
    fn(header)
    return ref.build_payload(header, RECORDS, sync=False)


def record(name: str) -> int:
    """The place of tensor ``name`` in the small payload's header."""
    return [e[0] for e in HEADER["tensors"]].index(name)


def set_field(name: str, field: str, value: Any) -> Callable[[dict], None]:
    """A header change for ``mutated``: entry ``field`` (``ref.ENTRY_FIELDS``) of ``name``."""

    def fn(header: dict) -> None:
        header["tensors"][record(name)][ref.ENTRY_FIELDS.index(field)] = value

    return fn


_KEEP = object()


def with_sections(name: str, *, rice_bits: Any = _KEEP, **sections: bytes) -> bytes:
    """The small payload with tensor ``name``'s record sections (``codes``, ``unary``,
    ``remainders``) replaced and, if given, its Rice parameter; lengths and CRCs made to match,
    so the record's inner checks run."""
    i = record(name)
    parts = dict(zip(ref.SECTIONS, RECORDS[i], strict=True))
    parts.update(sections)
    records = list(RECORDS)
    records[i] = (parts["codes"], parts["unary"], parts["remainders"])
    header = copy.deepcopy(HEADER)
    if rice_bits is not _KEEP:
        header["tensors"][i][2] = rice_bits
    return ref.build_payload(header, records)


def with_stored_codes(codes: bytes, codes_zstd: Any = 1) -> bytes:
    """``ZSTD`` with "w"'s codes as stored replaced by ``codes`` and its entry's ``codes_zstd``
    set; lengths and CRC made to match, so the frame's own checks run."""
    records = list(ZSTD_RECORDS)
    records[ZSTD_AT] = (codes, *records[ZSTD_AT][1:])
    header = copy.deepcopy(ZSTD_HEADER)
    header["tensors"][ZSTD_AT][ref.ZSTD] = codes_zstd
    return ref.build_payload(header, records)
