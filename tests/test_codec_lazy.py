"""Lazy payloads: validated completely up front, decoded tensor by tensor while aggregating.

The node reads every gathered payload lazily so a round (or a long catch-up) holds one decoded
tensor per peer at a time. That must change nothing: the same tensors, the same aggregate to
the bit, and a malformed last tensor still rejected before anything is applied.
"""

from __future__ import annotations

import pytest
import torch

from node.compute.outer import apply_aggregate
from protocol.codec import encode, read_payload
from protocol.errors import PayloadError
from support.malformed_fixtures import BODY, ENCODED, MODEL, TILE, TOPK, mutated, set_field


def test_lazy_tensors_equal_eager_ones() -> None:
    eager = read_payload(ENCODED, MODEL, topk=TOPK, tile=TILE)
    lazy = read_payload(ENCODED, MODEL, topk=TOPK, tile=TILE, lazy=True)
    assert not isinstance(lazy.tensors, dict)
    assert list(lazy.tensors) == list(eager.tensors) and len(lazy.tensors) == len(MODEL)
    for name, t in eager.tensors.items():
        other = lazy.tensors[name]
        assert torch.equal(other.index, t.index) and torch.equal(other.codes, t.codes)
        assert torch.equal(other.table, t.table)
        assert torch.equal(other.dense(), t.dense())


def test_lazy_aggregation_is_bit_identical() -> None:
    shapes = {"w": (64, 128), "v": (128,)}
    gen = torch.Generator().manual_seed(3)
    blobs = {
        f"n{i}": encode(
            {n: torch.randn(s, generator=gen) for n, s in shapes.items()}, topk=64, tile=64
        )[0]
        for i in range(4)
    }
    results = []
    for lazy in (False, True):
        theta = {n: torch.zeros(s) for n, s in shapes.items()}
        payloads = {k: read_payload(b, shapes, lazy=lazy) for k, b in blobs.items()}
        apply_aggregate(theta, payloads, alpha=1.0, clip=True)
        results.append(theta)
    for name in shapes:
        assert torch.equal(results[0][name], results[1][name])


def test_a_bad_last_tensor_is_still_rejected_up_front() -> None:
    last = sorted(MODEL)[-1]
    n_codes = len(BODY["tensors"][-1][4])
    bad = mutated(set_field(last, "codes", b"\xff" * (n_codes + 1)))
    with pytest.raises(PayloadError, match=r"tensors\[2\]\.codes"):
        read_payload(bad, MODEL, lazy=True)
