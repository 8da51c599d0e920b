"""Shared fixtures of the malformed-payload tests: a small valid payload and ways to break it.

Every helper rewraps a mutated body with a valid CRC-32, so the deeper validation runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, settings

from protocol.codec import decode, encode, read_payload
from protocol.envelope import wrap_body
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
BODY: dict[str, Any] = ref.split_payload(ENCODED)[2]
# A compressible payload (constant input: zero gaps, equal codes) to exercise the zstd path.
ZMODEL: dict[str, tuple[int, ...]] = {"z": (64, 64)}
ZSTD_SMALL, _ = encode({"z": torch.ones(64, 64)}, topk=8, tile=16)
BIG_MODEL = {"w": (256, 512), "v": (512,)}
BIG, _ = encode(
    {n: torch.randn(s, generator=torch.Generator().manual_seed(9)) for n, s in BIG_MODEL.items()}
)


def reject(data: Any, model: dict = MODEL, **kwargs: Any) -> PayloadError:
    """Decode ``data`` every way (eager, lazy as the node reads, dense); each must raise
    PayloadError, the lazy check naming the same field as the eager decode; returns the error."""
    with pytest.raises(PayloadError) as err:
        read_payload(data, model, **kwargs)
    assert isinstance(err.value, ValueError)
    assert isinstance(err.value.field, str) and err.value.field
    with pytest.raises(PayloadError) as lazy:
        read_payload(data, model, lazy=True, **kwargs)
    assert lazy.value.field == err.value.field
    with pytest.raises(PayloadError):
        decode(data, model)
    return err.value


def check_valid_or_rejected(data: bytes, model: dict = MODEL) -> None:
    """``data`` either raises PayloadError or decodes to a self-consistent payload; the lazy
    check (the node's path) reaches the same verdict, naming the same field."""
    try:
        read_payload(data, model, lazy=True)
        lazy_field = None
    except PayloadError as err:
        lazy_field = err.field
    try:
        payload = read_payload(data, model)
    except PayloadError as err:
        assert isinstance(err.field, str) and err.field
        assert lazy_field == err.field
        return
    assert lazy_field is None
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


def rewrap(body: Any, *, zstd: bool = False) -> bytes:
    """``body`` packed with msgpack and wrapped with a valid header (via wrap_body)."""
    raw = msgpack.packb(body, use_bin_type=True)
    if zstd:
        raw = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
    return wrap_body(raw, 1 if zstd else 0)


def mutated(fn: Callable[[dict], Any]) -> bytes:
    """A copy of the small payload's body changed in place by ``fn``."""
    body = copy.deepcopy(BODY)
    fn(body)
    return rewrap(body)


SMALL = rewrap(BODY)  # the same body stored plain (the encoder chose zstd, a little smaller)


def record(name: str) -> int:
    return [r[0] for r in BODY["tensors"]].index(name)


def set_field(name: str, field: str, value: Any) -> Callable[[dict], None]:
    def fn(body: dict) -> None:
        body["tensors"][record(name)][ref.RECORD_FIELDS.index(field)] = value

    return fn
