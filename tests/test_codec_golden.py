"""Golden payload files pin the wire format: changing it must break these tests.

``tests/golden/<name>.slc`` was written by ``tests/golden/regenerate.py`` from the recipe in
``<name>.json``. Re-encoding the recipe must give the same bytes, and decoding the file must
give the encoder's reconstruction bit for bit. A failure here means the format (or the codec's
numerics) changed: bump the format version and regenerate, never just regenerate.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard

from protocol.codec import decode, read_payload

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


def test_golden_files_exist_for_every_case() -> None:
    assert sorted(regen.CASES) == NAMES
    assert len(NAMES) >= 3
    flags = {_load(name)[1]["flags"] for name in NAMES}
    assert flags == {0, 1}, "the goldens should cover both a plain and a zstd body"


@pytest.mark.parametrize("name", NAMES)
def test_sidecar_describes_the_file(name: str) -> None:
    data, meta = _load(name)
    assert hashlib.sha256(data).hexdigest() == meta["payload_sha256"]
    assert len(data) == meta["payload_size"]
    assert data[:4] == b"SLCP"
    assert data[4] == meta["format_version"] == 1
    assert data[5] == meta["flags"]
    case = regen.CASES[name]
    for key in ("topk", "tile", "header", "tensors"):
        assert meta[key] == case[key]


@pytest.mark.parametrize("name", NAMES)
def test_recipe_reencodes_to_the_same_bytes(name: str) -> None:
    data, meta = _load(name)
    tensors = regen.make_inputs(meta)
    # If this fails, the input generator drifted, not the codec.
    assert regen.input_digest(tensors) == meta["input_sha256"]
    payload, _, _ = regen.build(meta)
    assert payload[:6] == data[:6]
    assert _body(payload) == _body(data), "the body changed: a format change needs a new version"
    if payload != data and meta["flags"] & 1:
        zstd = ".".join(map(str, zstandard.ZSTD_VERSION))
        if zstd != meta["zstd_version"]:
            pytest.skip(f"same body, compressed by zstd {zstd} (golden: {meta['zstd_version']})")
    assert payload == data, "the encoder's bytes changed: a format change needs a new version"


def _body(data: bytes) -> bytes:
    """The msgpack body as stored, decompressed when the zstd flag is set."""
    body = data[10:]
    if data[5] & 1:
        body = zstandard.ZstdDecompressor().decompress(body)
    return body


@pytest.mark.parametrize("name", NAMES)
def test_golden_decodes_to_the_reconstruction(name: str) -> None:
    data, meta = _load(name)
    model = {n: tuple(spec["shape"]) for n, spec in meta["tensors"].items()}
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
