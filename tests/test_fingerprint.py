"""Every way of computing a fingerprint against every other, and against its definition.

The fingerprint (``protocol.fingerprint``, version 2) is a node's word on θ and what the
coordinator (no torch) trusts a checkpoint by, so ``fingerprint`` on torch tensors, the
pure-Python ``fingerprint_safetensors`` on a file's bytes, ``SafetensorsDigest`` fed the same
bytes in chunks of any size and ``fingerprint_file`` on disk must all agree for every file a node
writes (random names, shapes including scalars and empty tensors, metadata); digests of any split
of the tensors must combine to it; and every malformed file must be refused by the in-memory and
the streaming reader alike, with a ``PayloadError`` naming the field.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

import protocol.fingerprint as fp_module
from protocol.errors import PayloadError
from protocol.fingerprint import (
    MAX_HEADER_BYTES,
    SafetensorsDigest,
    combine,
    digest_file,
    fingerprint,
    fingerprint_file,
    fingerprint_safetensors,
    tensor_digest,
)

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


def streamed(data: bytes, cuts: list[int], *, sha256: bool = True) -> SafetensorsDigest:
    """A reader fed ``data`` cut at ``cuts`` (any positions, sorted here)."""
    reader = SafetensorsDigest(sha256=sha256)
    bounds = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    for start, end in itertools.pairwise(bounds):
        reader.update(memoryview(data)[start:end])
    return reader


def one_byte_at_a_time(data: bytes) -> SafetensorsDigest:
    reader = SafetensorsDigest()
    for i in range(len(data)):
        reader.update(data[i : i + 1])
    return reader


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tensors=tensor_dicts(),
    meta=st.dictionaries(st.text(max_size=8), st.text(max_size=8)),
    cuts=st.lists(st.integers(0, 10**6), max_size=12),
)
def test_every_way_agrees(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], cuts: list[int], tmp_path: Path
) -> None:
    data = save(tensors, metadata=meta or None)
    expected = fingerprint(tensors)
    assert fingerprint_safetensors(data) == expected
    checked = streamed(data, cuts).finish()
    assert checked.fingerprint == expected
    assert checked.sha256 == hashlib.sha256(data).hexdigest() and checked.size == len(data)
    assert {n: e[1] for n, e in checked.entries.items()} == {
        n: tuple(t.shape) for n, t in tensors.items()
    }
    assert one_byte_at_a_time(data).finish().fingerprint == expected
    path = tmp_path / "theta.safetensors"
    path.write_bytes(data)
    assert fingerprint_file(path) == expected
    assert digest_file(path, sha256=True).sha256 == checked.sha256


@settings(max_examples=100, deadline=None)
@given(tensors=tensor_dicts(), data=st.data())
def test_any_flipped_bit_changes_it(tensors: dict[str, torch.Tensor], data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(tensors)))
    t = tensors[name].clone()
    if not t.numel():
        t = torch.zeros(1)  # a new shape changes it as surely
    raw = t.reshape(-1).view(torch.uint8)
    bit = data.draw(st.integers(0, raw.numel() * 8 - 1))
    raw[bit // 8] ^= 1 << (bit % 8)
    changed = {**tensors, name: t}
    assert fingerprint(changed) != fingerprint(tensors)
    assert fingerprint_safetensors(save(changed)) == fingerprint(changed)


@settings(max_examples=100, deadline=None)
@given(tensors=tensor_dicts(), data=st.data())
def test_digests_of_any_split_combine_to_the_whole(
    tensors: dict[str, torch.Tensor], data: st.DataObject
) -> None:
    """As the ranks of a node do it: each hashes its own tensors; the digests meet anywhere."""
    ranks = data.draw(st.integers(1, 4))
    owner = {n: data.draw(st.integers(0, ranks - 1)) for n in tensors}
    shares = [
        {n: tensor_digest(n, t) for n, t in tensors.items() if owner[n] == r} for r in range(ranks)
    ]
    arrived = data.draw(st.permutations(shares))
    merged: dict[str, bytes] = {}
    for share in arrived:
        merged.update(share)
    assert combine(merged) == fingerprint(tensors)


def test_threads_give_the_same_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    tensors = {f"w{i}": torch.randn(50 + 37 * i, generator=gen) for i in range(9)}
    single = combine({n: tensor_digest(n, t) for n, t in tensors.items()})
    monkeypatch.setattr(fp_module, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(fp_module, "FINGERPRINT_THREADS", 3)
    assert fingerprint(tensors) == single


def test_the_fingerprint_is_the_documented_definition() -> None:
    """The reference: each tensor's line and bytes through BLAKE3 (32 bytes), then BLAKE3 of
    the version line and the digests in name order, 32 hex digits."""
    tensors = {"b": torch.arange(6, dtype=torch.float32).view(2, 3), "a": torch.tensor(1.5)}
    digest_a = blake3(b"a|torch.float32|()\n" + struct.pack("<f", 1.5)).digest()
    digest_b = blake3(b"b|torch.float32|(2, 3)\n" + struct.pack("<6f", *range(6))).digest()
    assert tensor_digest("a", tensors["a"]) == digest_a
    expected = blake3(b"sparseloco-fingerprint-2\n" + digest_a + digest_b).hexdigest()[:32]
    assert fingerprint(tensors) == expected
    assert fingerprint_safetensors(save(tensors)) == expected
    # Code point order: "B" (66) before "a" (97), "é" after both.
    upper = {"é": torch.ones(1), "a": torch.ones(1), "B": torch.ones(1)}
    parts = b"".join(tensor_digest(n, upper[n]) for n in ("B", "a", "é"))
    assert fingerprint(upper) == blake3(b"sparseloco-fingerprint-2\n" + parts).hexdigest()[:32]


def test_a_digest_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(PayloadError, match="digests"):
        combine({"a": b"\x00" * 31})


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
    # Empty tensors anywhere between others, offsets in any order in the header.
    header = {"z": _entry([0], [8, 8]), "b": _entry([1], [4, 8]), "a": _entry([1], [0, 4])}
    header |= {"y": _entry([2, 0], [0, 0]), "x": _entry([], [8, 12])}
    tensors = {"a": torch.zeros(1), "b": torch.zeros(1), "x": torch.tensor(0.0)}
    tensors |= {"y": torch.zeros(2, 0), "z": torch.zeros(0)}
    assert one_byte_at_a_time(_file(header, b"\x00" * 12)).finish().fingerprint == fingerprint(
        tensors
    )


MALFORMED: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "header.length"),
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
    "lone surrogate": (
        _file({"\ud800": _entry([2], [0, 8])}, b"\x00" * 8),  # json.dumps escapes it
        "tensors[",
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


def _refusal(read: Any) -> PayloadError:
    with pytest.raises(PayloadError) as info:
        read()
    return info.value


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_files_are_refused_by_every_reader(case: str, tmp_path: Path) -> None:
    data, field = MALFORMED[case]
    path = tmp_path / "bad.safetensors"
    path.write_bytes(data)
    rng = random.Random(case)
    readers = {
        "bytes": lambda: fingerprint_safetensors(data),
        "header": lambda: fp_module.read_header(memoryview(data)),
        "file": lambda: fingerprint_file(path),
        "1-byte chunks": lambda: one_byte_at_a_time(data).finish(),
        "random chunks": lambda: streamed(
            data, [rng.randrange(len(data) + 1) for _ in range(5)]
        ).finish(),
    }
    for how, read in readers.items():
        error = _refusal(read)
        assert field in error.field, (case, how, error)
    # Once refused, a reader stays refused.
    reader = SafetensorsDigest()

    def read_all() -> None:
        reader.update(data)
        reader.finish()

    first = _refusal(read_all)
    assert _refusal(reader.finish) is first
    assert _refusal(lambda: reader.update(b"\x00")) is first


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=4))
def test_random_bytes_never_crash(data: bytes, cuts: list[int]) -> None:
    results = []
    for read in (
        lambda: fingerprint_safetensors(data),
        lambda: streamed(data, cuts).finish().fingerprint,
    ):
        with contextlib.suppress(PayloadError):
            results.append(read())
    assert len(results) in (0, 2) and len(set(results)) <= 1


def test_the_streaming_reader_holds_one_chunk_of_the_data() -> None:
    """Memory: the header and a BLAKE3 state, never the data section (16 MB here)."""
    import tracemalloc

    big = {"w": torch.randn(1 << 22), "v": torch.randn(3, 1000)}
    data = memoryview(save(big))
    tracemalloc.start()
    try:
        reader = SafetensorsDigest()
        for start in range(0, len(data), 1 << 16):
            reader.update(data[start : start + (1 << 16)])
        checked = reader.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert checked.fingerprint == fingerprint(big)
    assert peak < 256 << 10, peak
