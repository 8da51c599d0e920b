"""The naive baseline computes what the real codec and aggregation compute (else the benchmark
comparing them would be meaningless)."""

from __future__ import annotations

import pytest
import torch

from node.compute.outer import AggregateOptions, aggregate_tensor, apply_aggregate
from node.research.bench import naive
from protocol.codec import encode, read_payload

SHAPES: dict[str, tuple[int, ...]] = {"emb": (128, 192), "norm": (320,), "w": (64, 96)}


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * (1 + seed) for n, s in SHAPES.items()}


def test_pack12_roundtrip() -> None:
    idx = torch.randint(0, 4096, (7,))
    assert len(naive.pack12(idx)) == 12
    assert torch.equal(naive.unpack12(naive.pack12(idx), 7), idx)


@pytest.mark.parametrize("topk", [64, 128])
def test_encode_keeps_the_same_positions(topk: int) -> None:
    x = _tensors(0)
    data, recon = encode(x, topk=topk)
    ndata, nrecon = naive.encode(x, topk=topk)
    ours = read_payload(data, SHAPES).tensors
    theirs = naive.read(ndata, SHAPES, topk=topk)
    for name in SHAPES:
        assert torch.equal(ours[name].positions.long(), theirs[name].positions.sort(1).values)
        assert torch.equal(recon[name] != 0, nrecon[name] != 0)
        torch.testing.assert_close(nrecon[name], recon[name], rtol=1e-5, atol=1e-6)
        assert len(ndata) == sum(naive.record_size(t.geometry) for t in theirs.values())


@pytest.mark.parametrize("clip", [True, False])
def test_aggregate_agrees_with_ours(clip: bool) -> None:
    inputs = [_tensors(seed) for seed in range(5)]
    ours = [read_payload(encode(x)[0], SHAPES) for x in inputs]
    payloads = [naive.encode(x)[0] for x in inputs]
    theirs = [naive.read(d, SHAPES) for d in payloads]
    got = naive.aggregate(theirs, clip=clip)
    for name in SHAPES:
        want = aggregate_tensor([p.tensors[name] for p in ours], clip=clip)
        # Values reach ~15 and peers cancel: allow a few fp32 ulps of the magnitude.
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5)

    params = {n: torch.ones(s) for n, s in SHAPES.items()}
    nparams = {n: torch.ones(s) for n, s in SHAPES.items()}
    apply_aggregate(
        params, {f"n{i}": p for i, p in enumerate(ours)}, AggregateOptions(alpha=0.5, clip=clip)
    )
    naive.apply(nparams, payloads, alpha=0.5, clip=clip)
    for name in SHAPES:
        torch.testing.assert_close(nparams[name], params[name], rtol=1e-5, atol=1e-5)
