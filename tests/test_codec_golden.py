"""Golden payload files pin the wire format: changing it must break these tests.

``tests/golden/<name>.slc`` was written by ``tests/golden/regenerate.py`` from the recipe in
``<name>.json``. Re-encoding the recipe must give the same bytes, the sidecar's layout (header
length, each record's offset, lengths, CRC and form of codes) must be what the independent reader in
``support.reference_codec`` finds, and decoding the file, whole, partially or from disk, must
give the encoder's reconstruction bit for bit. A failure here means the format (or the codec's
numerics) changed: bump the format version and regenerate, never just regenerate. One thing may
change without that: the bytes of a zstd frame of codes, under another zstd release than the
sidecar's (FORMAT.md leaves them to the writer); the payload must then still be the same once
every record's codes are stored raw.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from protocol.codec import decode, read_payload, read_payload_file
from support import reference_codec as ref

GOLDEN = Path(__file__).resolve().parent / "golden"
NAMES = sorted(p.stem for p in GOLDEN.glob("*.slc"))


def _load_regenerate() -> Any:
    spec = importlib.util.spec_from_file_location("golden_regenerate", GOLDEN / "regenerate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


regen = _load_regenerate()


def _load(name: str) -> tuple[bytes, dict[str, Any]]:
    return (GOLDEN / f"{name}.slc").read_bytes(), json.loads((GOLDEN / f"{name}.json").read_text())


def _model(meta: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(spec["shape"]) for n, spec in meta["tensors"].items()}


def test_golden_files_exist_for_every_case() -> None:
    assert sorted(regen.CASES) == NAMES
    assert len(NAMES) >= 3


@pytest.mark.parametrize("name", NAMES)
def test_sidecar_describes_the_file(name: str) -> None:
    data, meta = _load(name)
    assert hashlib.sha256(data).hexdigest() == meta["payload_sha256"]
    assert len(data) == meta["payload_size"]
    assert data[:4] == b"SLCP"
    assert data[4] == meta["format_version"] == 3
    assert data[5] == meta["flags"] == 0
    case = regen.CASES[name]
    for key in ("topk", "tile", "header", "tensors"):
        assert meta[key] == case[key]
    # The layout, read by the independent reader, is the sidecar's.
    split = ref.split_payload(data)
    assert split.header_length == meta["header_length"]
    entries = split.header["tensors"]
    assert [e[0] for e in entries] == sorted(meta["tensors"]) == list(meta["records"])
    for entry, offset in zip(entries, split.offsets, strict=True):
        want = meta["records"][entry[0]]
        assert offset == want["offset"]
        assert entry[4:] == [
            want["codes_len"],
            want["unary_len"],
            want["remainders_len"],
            want["crc32"],
            want["codes_zstd"],
        ]


def test_the_goldens_pin_both_forms_of_codes() -> None:
    """At least one record's codes are a zstd frame and at least one's are raw."""
    forms = {r["codes_zstd"] for name in NAMES for r in _load(name)[1]["records"].values()}
    assert forms == {0, 1}


@pytest.mark.parametrize("name", NAMES)
def test_recipe_reencodes_to_the_same_bytes(name: str) -> None:
    data, meta = _load(name)
    tensors = regen.make_inputs(meta)
    # If this fails, the input generator drifted, not the codec.
    assert regen.input_digest(tensors) == meta["input_sha256"]
    payload, _, _ = regen.build(meta)
    if meta["zstd_version"] != regen.zstd_version():  # frames may differ: compare the rest
        params = {"topk": meta["topk"], "tile": meta["tile"]}
        payload, data = ref.with_raw_codes(payload, **params), ref.with_raw_codes(data, **params)
    assert payload == data, "the encoder's bytes changed: a format change needs a new version"


@pytest.mark.parametrize("name", NAMES)
def test_golden_decodes_to_the_reconstruction(name: str, tmp_path: Path) -> None:
    data, meta = _load(name)
    model = _model(meta)
    _, recon, _ = regen.build(meta)
    decoded = decode(data, model)
    assert sorted(decoded) == sorted(model)
    for n, t in decoded.items():
        assert t.dtype == torch.float32 and t.shape == model[n]
        assert torch.equal(t.view(torch.int32), recon[n].view(torch.int32))
    payload = read_payload(data, model, topk=meta["topk"], tile=meta["tile"])
    header = meta["header"]
    assert (payload.run_id, payload.round, payload.node_id, payload.base) == (
        header["run_id"],
        header["round"],
        header["node_id"],
        header["base"],
    )
    # Each tensor read alone, from memory and from the file, is the same reconstruction.
    path = tmp_path / f"{name}.slc"
    path.write_bytes(data)
    for n in model:
        for part in (read_payload(data, model, only=[n]), read_payload_file(path, model, only=[n])):
            assert list(part.tensors) == [n]
            got = part.tensors[n].dense()
            assert torch.equal(got.view(torch.int32), recon[n].view(torch.int32))
