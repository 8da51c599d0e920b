"""Rewrite the golden payload files that pin the wire format (format version 3).

Run from the repository root: ``python tests/golden/regenerate.py``. Only do so together with
a format version bump: ``tests/test_codec_golden.py`` fails whenever the encoder's bytes for
these inputs change, and that failure is the point.

Each case is a ``<name>.slc`` payload and a ``<name>.json`` sidecar holding the codec
parameters, header fields, every tensor's shape and input recipe, the sha256 of both the input
values and the payload, the header's length and where each record lies (offset, the three
section lengths, CRC-32, whether the codes are a zstd frame) as FORMAT.md defines them. The
cases hold records of both forms of codes: raw, and zstd frames (the equal codes of "ones"); a
frame's bytes are zstd's, so the sidecar also records the zstd release that wrote them. Inputs
come from Python's ``random.Random(seed).random()``, whose sequence Python guarantees across
versions, summed in float64 (twelve uniforms minus 6, roughly standard normal) and rounded once
to fp32: no dependence on torch's or numpy's generators.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

CASES: dict[str, dict[str, Any]] = {
    "dense_k64_t64": {
        "topk": 64,
        "tile": 64,
        "header": {
            "run_id": "golden-run",
            "round": 42,
            "node_id": "node-7",
            "base": "ab" * 32,
            "steps": 30,
            "tokens": 46080,
        },
        "tensors": {
            "layer.weight": {"shape": [64, 64], "kind": "normal", "seed": 1},
            "layer.bias": {"shape": [100], "kind": "normal", "seed": 2},
        },
    },
    "odd_k5_t8": {
        "topk": 5,
        "tile": 8,
        "header": {"run_id": "r", "round": 0, "node_id": "n", "base": ""},
        "tensors": {
            "t": {"shape": [3, 5, 7], "kind": "normal", "seed": 3},
        },
    },
    "ties_k64_t64": {  # equal magnitudes everywhere, and a scalar
        "topk": 64,
        "tile": 64,
        "header": {
            "run_id": "golden-run",
            "round": 7,
            "node_id": "node-ties",
            "base": "f00d",
            "steps": 11,
            "tokens": 2816,
        },
        "tensors": {
            "ones": {"shape": [64, 128], "kind": "ones", "seed": 0},
            "ints": {"shape": [128, 64], "kind": "ints", "seed": 5},
            "scalar": {"shape": [], "kind": "normal", "seed": 4},
        },
    },
}


def input_values(spec: dict[str, Any]) -> list[float]:
    """The input's values, row-major, as floats (rounded to fp32 by the caller)."""
    n = 1
    for d in spec["shape"]:
        n *= d
    rng = random.Random(spec["seed"])
    if spec["kind"] == "normal":
        return [sum(rng.random() for _ in range(12)) - 6.0 for _ in range(n)]
    if spec["kind"] == "ints":  # integers in [-3, 3]: ties in magnitude everywhere
        return [float(int(rng.random() * 7) - 3) for _ in range(n)]
    if spec["kind"] == "ones":
        return [1.0] * n
    raise ValueError(f"unknown input kind {spec['kind']!r}")


def make_inputs(case: dict[str, Any]) -> dict[str, Any]:
    """The case's input tensors (fp32)."""
    import torch

    return {
        name: torch.tensor(input_values(spec), dtype=torch.float32).reshape(spec["shape"])
        for name, spec in case["tensors"].items()
    }


def input_digest(tensors: dict[str, Any]) -> str:
    """sha256 over the names and little-endian fp32 bytes of the inputs, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        values = tensors[name].reshape(-1).tolist()
        h.update(name.encode() + b"\0" + struct.pack(f"<{len(values)}f", *values))
    return h.hexdigest()


def layout(payload: bytes) -> tuple[int, dict[str, dict[str, int]]]:
    """The header length and each record's place, read from the bytes per FORMAT.md."""
    import msgpack

    length = struct.unpack_from("<I", payload, 6)[0]
    header = msgpack.unpackb(payload[14 : 14 + length], raw=False)
    records, at = {}, 14 + length
    for name, _, _, _, codes, unary, remainders, crc, codes_zstd in header["tensors"]:
        records[name] = {
            "offset": at,
            "codes_len": codes,
            "unary_len": unary,
            "remainders_len": remainders,
            "crc32": crc,
            "codes_zstd": codes_zstd,
        }
        at += codes + unary + remainders
    return length, records


def zstd_version() -> str:
    """The release of the zstd library that compresses codes here, e.g. ``"1.5.7"``."""
    import zstandard

    return ".".join(map(str, zstandard.ZSTD_VERSION))


def build(case: dict[str, Any]) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
    """``(payload, reconstruction, sidecar)`` for one case."""
    from protocol.codec import encode

    tensors = make_inputs(case)
    payload, recon = encode(tensors, topk=case["topk"], tile=case["tile"], **case["header"])
    header_length, records = layout(payload)
    sidecar = {
        "format_version": payload[4],
        "flags": payload[5],
        **case,
        "input_sha256": input_digest(tensors),
        "payload_size": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
        "header_length": header_length,
        "records": records,
        "zstd_version": zstd_version(),
    }
    return payload, recon, sidecar


def main() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    for name, case in CASES.items():
        payload, _, sidecar = build(case)
        (HERE / f"{name}.slc").write_bytes(payload)
        (HERE / f"{name}.json").write_text(json.dumps(sidecar, indent=2) + "\n")
        print(f"{name}: {len(payload)} bytes, sha256 {sidecar['payload_sha256']}")


if __name__ == "__main__":
    main()
