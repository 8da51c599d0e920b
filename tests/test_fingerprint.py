"""The pure-Python fingerprint of a safetensors file against ``fingerprint`` on torch tensors.

``fingerprint_safetensors`` is what the coordinator (no torch) checks an uploaded checkpoint
with, so it must equal ``fingerprint`` of the same tensors for every file a node writes (random
names, shapes including scalars and empty tensors, metadata), and refuse every malformed file
with a ``PayloadError`` naming the field.
"""

from __future__ import annotations

import contextlib
import json
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from protocol.errors import PayloadError
from protocol.fingerprint import MAX_HEADER_BYTES, fingerprint, fingerprint_safetensors

names = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=24
).filter(lambda n: n != "__metadata__")
shapes = st.lists(st.integers(0, 5), max_size=4)


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    keys = draw(st.lists(names, min_size=1, max_size=6, unique=True))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(draw(shapes), generator=gen) for k in keys}


@settings(max_examples=150, deadline=None)
@given(tensors=tensor_dicts(), meta=st.dictionaries(st.text(max_size=8), st.text(max_size=8)))
def test_equals_fingerprint_of_the_same_tensors(
    tensors: dict[str, torch.Tensor], meta: dict[str, str]
) -> None:
    data = save(tensors, metadata=meta or None)
    assert fingerprint_safetensors(data) == fingerprint(tensors)
    # Any one changed bit of the data changes it.
    flipped = bytearray(data)
    flipped[-1] ^= 1
    if sum(t.numel() for t in tensors.values()):
        assert fingerprint_safetensors(bytes(flipped)) != fingerprint(tensors)


def _file(header: dict[str, Any], data: bytes, *, pad: bytes = b"") -> bytes:
    raw = json.dumps(header).encode() + pad
    return struct.pack("<Q", len(raw)) + raw + data


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def _entry(shape: Any, offsets: Any, dtype: Any = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


def test_a_hand_made_file_reads() -> None:
    data = b"\x00" * 8
    expected = fingerprint({"a": torch.zeros(2)})
    assert fingerprint_safetensors(_file(GOOD, data)) == expected
    assert fingerprint_safetensors(_file(GOOD, data, pad=b"     ")) == expected  # padding


MALFORMED: dict[str, tuple[bytes, str]] = {
    "short": (b"\x01\x00", "header.length"),
    "header too long": (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "header.length"),
    "header past the end": (struct.pack("<Q", 100) + b"{}", "header.length"),
    "not json": (struct.pack("<Q", 4) + b"{nop", "header.json"),
    "not utf-8": (struct.pack("<Q", 3) + b'"\xff"', "header.json"),
    "not an object": (_file([1, 2], b""), "header.json"),  # type: ignore[arg-type]
    "duplicate key": (
        struct.pack("<Q", 2 * len(json.dumps(GOOD)) - 1)
        + (json.dumps(GOOD)[:-1] + "," + json.dumps(GOOD)[1:]).encode()
        + b"\x00" * 8,
        "header.json",
    ),
    "no tensor": (_file({"__metadata__": {}}, b""), "header.tensors"),
    "bad metadata": (_file({"__metadata__": {"k": 1}, **GOOD}, b"\x00" * 8), "header.__metadata__"),
    "float16": (_file({"a": _entry([2], [0, 4], "F16")}, b"\x00" * 4), "tensors['a'].dtype"),
    "extra field": (
        _file({"a": {**_entry([2], [0, 8]), "x": 1}}, b"\x00" * 8),
        "tensors['a']",
    ),
    "bool in shape": (_file({"a": _entry([True], [0, 4])}, b"\x00" * 4), "tensors['a'].shape"),
    "negative size": (_file({"a": _entry([-1], [0, 0])}, b""), "tensors['a'].shape"),
    "float offset": (_file({"a": _entry([2], [0.0, 8])}, b"\x00" * 8), "data_offsets"),
    "reversed range": (_file({"a": _entry([0], [8, 0])}, b"\x00" * 8), "data_offsets"),
    "wrong byte count": (_file({"a": _entry([3], [0, 8])}, b"\x00" * 8), "data_offsets"),
    "gap": (_file({"a": _entry([2], [4, 12])}, b"\x00" * 12), "data_offsets"),
    "overlap": (
        _file({"a": _entry([2], [0, 8]), "b": _entry([2], [4, 12])}, b"\x00" * 12),
        "data_offsets",
    ),
    "past the end": (_file(GOOD, b"\x00" * 4), "data"),
    "trailing bytes": (_file(GOOD, b"\x00" * 9), "data"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_are_refused(case: str) -> None:
    data, field = MALFORMED[case]
    with pytest.raises(PayloadError) as info:
        fingerprint_safetensors(data)
    assert field in info.value.field, (case, info.value)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200))
def test_random_bytes_never_crash(data: bytes) -> None:
    with contextlib.suppress(PayloadError):
        fingerprint_safetensors(data)


def test_the_fingerprint_is_blake3_of_the_documented_stream() -> None:
    """The reference: the module docstring's byte stream, hashed with BLAKE3, 32 hex digits."""
    from blake3 import blake3

    tensors = {"b": torch.arange(6, dtype=torch.float32).view(2, 3), "a": torch.tensor(1.5)}
    stream = b"a|torch.float32|()\n" + struct.pack("<f", 1.5)
    stream += b"b|torch.float32|(2, 3)\n" + struct.pack("<6f", *range(6))
    expected = blake3(stream).hexdigest()[:32]
    assert fingerprint(tensors) == expected
    assert fingerprint_safetensors(save(tensors)) == expected
