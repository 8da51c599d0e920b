"""The encoder's input checks: non-finite values, values at the edge of fp32, bad codec
parameters, non-float tensors and header fields the format cannot carry all raise CodecError,
and anything the encoder accepts decodes.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from protocol.codec import decode, encode
from protocol.errors import CodecError
from support.codec_inputs import FLT_MAX, KINDS, bits, codec_params, make_input, shapes


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("where", [0, 17, 63, 4095])
def test_non_finite_input_is_rejected(bad: float, where: int) -> None:
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    x.view(-1)[where] = bad
    with pytest.raises(CodecError):
        encode({"ok": torch.ones(3), "x": x})


@pytest.mark.parametrize(
    ("values", "topk", "tile"),
    [
        ([math.nan, 1.0, 1.0, 1.0], 8, 4),  # k=2: the NaN loses to the tied ones
        ([math.nan, 2.0, 1.0, 1.0], 12, 4),  # k=3
        ([math.nan, math.nan, 1.0, 1.0], 12, 4),  # k=3: currently a RuntimeError
        ([1.0] * 63 + [math.nan] + [1.0] * 64, 128, 64),  # k=2
    ],
    ids=["nan-tie-k2", "nan-tie-k3", "two-nans-k3", "nan-among-ones"],
)
def test_nan_among_tied_magnitudes_is_rejected(values: list[float], topk: int, tile: int) -> None:
    """A NaN anywhere must raise CodecError, also when the tile's k-th and (k+1)-th magnitudes
    are tied (the Top-k tie-break path)."""
    with pytest.raises(CodecError):
        encode({"x": torch.tensor(values)}, topk=topk, tile=tile)


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes().filter(lambda s: math.prod(s) > 0),
    params=codec_params(),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**31),
    where=st.integers(0, 10**6),
    bad=st.sampled_from([math.nan, math.inf, -math.inf]),
)
def test_non_finite_anywhere_is_rejected(
    shape: tuple[int, ...], params: tuple[int, int], kind: str, seed: int, where: int, bad: float
) -> None:
    topk, tile = params
    x = make_input(shape, kind, seed)
    x.view(-1)[where % x.numel()] = bad
    with pytest.raises(CodecError):
        encode({"x": x}, topk=topk, tile=tile)


@pytest.mark.parametrize(
    "values",
    [
        [FLT_MAX, FLT_MAX / 2, FLT_MAX, FLT_MAX, FLT_MAX],  # level + shift rounds up to inf
        [3.4e38, -3.4e38, -3.4e38],  # a level beyond fp32 range: OverflowError in struct
        [FLT_MAX, -FLT_MAX],
        [FLT_MAX] * 4,
    ],
    ids=["table-overflows", "level-overflows", "symmetric", "constant-max"],
)
def test_extreme_finite_values_encode_or_raise_codec_error(values: list[float]) -> None:
    """Finite fp32 input near the range limit: either a payload that decodes to the (finite)
    reconstruction, or a CodecError; never another exception or an undecodable payload."""
    x = torch.tensor(values, dtype=torch.float32)
    try:
        payload, recon = encode({"x": x}, topk=4096, tile=64)
    except CodecError:
        return
    assert bool(torch.isfinite(recon["x"]).all())
    assert torch.equal(bits(decode(payload, {"x": x.shape})["x"]), bits(recon["x"]))


@pytest.mark.parametrize(
    ("topk", "tile"),
    [
        (0, 64),
        (4097, 64),
        (-1, 64),
        (True, 64),
        (64.0, 64),
        ("64", 64),
        (None, 64),
        (1, 0),
        (1, -1),
        (1, 1025),
        (1, True),
        (1, 8.0),
        (2, 1),
    ],
)
def test_bad_codec_parameters_are_rejected(topk: object, tile: object) -> None:
    with pytest.raises(CodecError):
        encode({"x": torch.ones(4, 4)}, topk=topk, tile=tile)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [
        torch.arange(6),
        torch.ones(3, dtype=torch.bool),
        torch.ones(3, dtype=torch.complex64),
        [1.0, 2.0],
        None,
    ],
    ids=["int", "bool", "complex", "list", "none"],
)
def test_non_float_tensors_are_rejected(value: object) -> None:
    with pytest.raises(CodecError):
        encode({"x": value})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("tensors", "header"),
    [
        ({"x": torch.ones(3)}, {"run_id": "r" * 257}),
        ({"x": torch.ones(3)}, {"node_id": "n" * 257}),
        ({"x": torch.ones(3)}, {"round": -1}),
        ({"x": torch.ones(3)}, {"round": 2**64}),
        ({"x": torch.ones(3)}, {"node_id": 123}),
        ({"n" * 257: torch.ones(3)}, {}),
        ({"x": torch.ones((1,) * 9)}, {}),
    ],
    ids=[
        "long-run-id",
        "long-node-id",
        "negative-round",
        "huge-round",
        "int-node-id",
        "long-name",
        "nine-dims",
    ],
)
def test_encode_never_emits_a_payload_the_decoder_rejects(tensors: dict, header: dict) -> None:
    """Anything encode accepts must decode; what the format cannot carry is a CodecError."""
    try:
        payload, recon = encode(tensors, **header)
    except CodecError:
        return
    model = {n: tuple(t.shape) for n, t in tensors.items()}
    out = decode(payload, model)
    assert all(torch.equal(out[n], recon[n]) for n in tensors)
