"""One payload of a small model whose records differ in kind (a zstd frame of codes, raw codes, a
scalar, an empty tensor), and its parts: what the partial-read and record tests share."""

from __future__ import annotations

from typing import Any

import torch

from protocol.codec import encode
from support import reference_codec as ref
from support.codec_inputs import bits

SHAPES: dict[str, tuple[int, ...]] = {
    "emb": (96, 128),
    "head.bias": (130,),
    "layer.0.w": (64, 64),
    "layer.1.w": (3, 5, 7),
    "norm": (),
    "unused": (0, 4),
}
NAMES = sorted(SHAPES)
HEADER: dict[str, Any] = {"run_id": "run-p", "round": 5, "node_id": "node-3", "base": "ab" * 32}


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    # Half of "emb" is +-1: fewer distinct codes, so its record stores them as a zstd frame.
    out["emb"][:48] = out["emb"][:48].sign()
    return out


PAYLOAD, RECON = encode(inputs(), **HEADER)
SPLIT = ref.split_payload(PAYLOAD)
#: The records whose codes are a zstd frame (the others' are raw).
ZSTD_CODED = [e[0] for e in SPLIT.header["tensors"] if e[ref.ZSTD]]


def assert_same(a: Any, b: Any) -> None:
    assert (a.run_id, a.round, a.node_id, a.base, a.tile, a.topk) == (
        b.run_id,
        b.round,
        b.node_id,
        b.base,
        b.tile,
        b.topk,
    )
    assert list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        x, y = a.tensors[name], b.tensors[name]
        assert torch.equal(x.index, y.index) and torch.equal(x.codes, y.codes)
        assert torch.equal(bits(x.table), bits(y.table))
