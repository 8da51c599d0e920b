"""The device path (torch operations) against the CPU path (numba), on the CPU: the same
payload bytes (codes stored raw or as zstd frames alike), the same reconstruction and the same
parameters after aggregation, bit for bit."""

from __future__ import annotations

import pytest
import torch

from node.compute import device
from node.compute.outer import AggregateOptions, apply_aggregate
from protocol.codec import decode, encode, read_payload
from support import reference_codec as ref

SHAPES: dict[str, tuple[int, ...]] = {
    "emb": (256, 128),
    "mlp": (128, 320),
    "norm": (128,),
    "odd": (7, 130),
    "conv": (16, 4, 3, 3),
    "tiny": (3,),
}


def _inputs(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s, generator=gen).pow(3) * scale for n, s in SHAPES.items()}
    # Ties in magnitude, exact zeros and a constant tile exercise the tie rule.
    out["emb"][:64, :64] = 0.5
    out["mlp"].view(-1)[::7] = 0.0
    out["odd"][:, :10] = -out["odd"][:, 10:20]
    return out


@pytest.mark.parametrize(("topk", "tile"), [(64, 64), (128, 64), (5, 8), (1, 4), (16, 4)])
def test_encode_is_byte_identical(topk: int, tile: int) -> None:
    x = _inputs(topk + tile)
    want, want_recon = encode(x, topk=topk, tile=tile, run_id="r", round=3, node_id="n")
    got, got_recon = device.encode(x, topk=topk, tile=tile, run_id="r", round=3, node_id="n")
    assert got == want
    for name in SHAPES:
        assert torch.equal(got_recon[name].view(torch.int32), want_recon[name].view(torch.int32))


def test_the_payloads_compared_store_codes_both_ways() -> None:
    """So that the byte comparisons above cover zstd-coded records as well as raw ones."""
    forms = set()
    for topk, tile in [(64, 64), (128, 64), (5, 8), (1, 4), (16, 4)]:
        data, _ = encode(_inputs(topk + tile), topk=topk, tile=tile)
        forms |= {e[ref.ZSTD] for e in ref.split_payload(data).header["tensors"]}
    assert forms == {0, 1}


@pytest.mark.parametrize(("topk", "tile"), [(64, 64), (5, 8)])
def test_decode_is_bit_identical(topk: int, tile: int) -> None:
    data, _ = encode(_inputs(1), topk=topk, tile=tile)  # (5, 8): zstd-coded records too
    want = decode(data, SHAPES)
    got = device.decode(read_payload(data, SHAPES, lazy=True), "cpu")
    for name in SHAPES:
        assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32))


@pytest.mark.parametrize("robust", [False, True])
@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("alpha", [1.0, 0.7])
def test_aggregation_is_bit_identical(robust: bool, clip: bool, alpha: float) -> None:
    datas = {}
    for i in range(6):
        x = _inputs(10 + i, scale=1.0 + 3 * (i == 2))
        if i == 4:  # a sign-flipping peer for the screening to find
            x = {n: -v for n, v in x.items()}
        datas[f"node-{i}"] = encode(x, topk=64, tile=64, node_id=f"node-{i}")[0]
    start = {
        n: torch.randn(s, generator=torch.Generator().manual_seed(7)) for n, s in SHAPES.items()
    }
    cpu = {n: v.clone() for n, v in start.items()}
    dev = {n: v.clone() for n, v in start.items()}
    lazy = {k: read_payload(d, SHAPES, lazy=True) for k, d in datas.items()}
    want = apply_aggregate(cpu, lazy, AggregateOptions(alpha=alpha, clip=clip, robust=robust))
    got = device.apply_aggregate(dev, lazy, AggregateOptions(alpha=alpha, clip=clip, robust=robust))
    assert got.rejected == want.rejected
    for name in SHAPES:
        assert torch.equal(dev[name].view(torch.int32), cpu[name].view(torch.int32))
        assert not torch.equal(dev[name], start[name])


def test_small_chunks_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    x = _inputs(3)
    want, _ = encode(x, topk=64, tile=64)
    monkeypatch.setattr(device, "CHUNK", 1)  # one band at a time
    got, _ = device.encode(x, topk=64, tile=64)
    assert got == want
    params = {n: torch.zeros(s) for n, s in SHAPES.items()}
    ref = {n: torch.zeros(s) for n, s in SHAPES.items()}
    lazy = {"a": read_payload(want, SHAPES, lazy=True), "b": read_payload(got, SHAPES, lazy=True)}
    device.apply_aggregate(params, lazy)
    apply_aggregate(ref, lazy)
    for name in SHAPES:
        assert torch.equal(params[name], ref[name])


def test_decode_wants_lazy_payloads() -> None:
    data, _ = encode(_inputs(0))
    with pytest.raises(TypeError, match="lazy"):
        device.decode(read_payload(data, SHAPES), "cpu")


def test_decode_of_a_partial_read_is_bit_identical() -> None:
    """A rank reads only its own tensors of a peer's payload; the device decodes those."""
    data, _ = encode(_inputs(2), topk=64, tile=64)
    only = ["conv", "emb", "tiny"]
    want = decode(data, SHAPES)
    got = device.decode(read_payload(data, SHAPES, lazy=True, only=only), "cpu")
    assert sorted(got) == only
    for name in only:
        assert torch.equal(got[name].view(torch.int32), want[name].view(torch.int32))
