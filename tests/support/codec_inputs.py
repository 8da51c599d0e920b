"""Seeded inputs for the codec tests: tensors of awkward shapes and value patterns.

``make_input`` builds one tensor from a shape, a kind of values (gaussian, scaled, small ints
with many ties, sparse, constant, alternating signs) and a seed; ``shapes`` and
``codec_params`` are the hypothesis strategies the property tests draw from; ``bits`` compares
fp32 tensors bit for bit.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import torch

FLT_MAX = float(np.finfo(np.float32).max)
DIMS = [1, 2, 3, 5, 7, 8, 13, 63, 64, 65, 97, 130]
MAX_NUMEL = 2600
KINDS = ["normal", "scaled", "ints", "sparse", "constant", "alternating"]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns of ``t`` (so -0.0 and 0.0 differ, like the bytes do)."""
    return t.contiguous().view(torch.int32)


def make_input(shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(shape, generator=g)
    if kind == "scaled":
        exp = int(torch.randint(-6, 7, (), generator=g))
        return torch.randn(shape, generator=g) * 10.0**exp
    if kind == "ints":  # many exact ties in magnitude, both signs
        return torch.randint(-3, 4, shape, generator=g).to(torch.float32)
    if kind == "sparse":
        x = torch.randn(shape, generator=g)
        return x * (torch.rand(shape, generator=g) < 0.1)
    if kind == "constant":
        return torch.full(shape, float(torch.randn((), generator=g)))
    # alternating signs of one magnitude: every entry ties
    n = math.prod(shape)
    return (torch.arange(n) % 2 * 2 - 1).to(torch.float32).reshape(shape) * 0.5


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    ndim = draw(st.integers(0, 3))
    shape: list[int] = []
    for _ in range(ndim):
        room = MAX_NUMEL // max(1, math.prod(shape))
        shape.append(draw(st.sampled_from([d for d in DIMS if d <= room])))
    return tuple(shape)


@st.composite
def codec_params(draw: st.DrawFn) -> tuple[int, int]:
    tile = draw(st.sampled_from([1, 3, 4, 8, 64]))
    topk = draw(st.one_of(st.integers(1, tile * tile), st.sampled_from([1, tile * tile])))
    return topk, tile
