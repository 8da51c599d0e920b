"""Lazy payloads: validated completely up front, decoded tensor by tensor while aggregating.

The node reads every gathered payload lazily so a round (or a long catch-up) holds one decoded
tensor per peer at a time. That must change nothing: the same tensors, the same aggregate to
the bit, and a malformed last tensor (a bad zstd frame of codes included) still rejected before
anything is applied; a zstd frame is decompressed once, while checking, and kept raw.
"""

from __future__ import annotations

import pytest
import torch

from node.compute.outer import AggregateOptions, apply_aggregate
from protocol.codec import encode, read_payload
from protocol.errors import PayloadError
from support import reference_codec as ref
from support.malformed_fixtures import (
    ENCODED,
    MODEL,
    RECORDS,
    TILE,
    TOPK,
    ZSTD,
    ZSTD_MODEL,
    ZSTD_RAW,
    ZSTD_RAW_SIZE,
    with_sections,
    with_stored_codes,
)


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
        apply_aggregate(theta, payloads, AggregateOptions(alpha=1.0, clip=True))
        results.append(theta)
    for name in shapes:
        assert torch.equal(results[0][name], results[1][name])


def test_a_bad_last_tensor_is_still_rejected_up_front() -> None:
    last = sorted(MODEL)[-1]
    n_codes = len(RECORDS[-1][0])
    bad = with_sections(last, codes=b"\xff" * n_codes)  # the right length, padding bits set
    with pytest.raises(PayloadError, match=r"tensors\[2\]\.codes"):
        read_payload(bad, MODEL, lazy=True)


def test_lazy_partial_reads_hold_exactly_the_chosen_tensors() -> None:
    eager = read_payload(ENCODED, MODEL)
    for only in ([], ["b"], ["c", "a"], list(MODEL)):
        lazy = read_payload(ENCODED, MODEL, lazy=True, only=only)
        assert list(lazy.tensors) == sorted(only)
        for name in only:
            assert torch.equal(lazy.tensors[name].index, eager.tensors[name].index)
            assert lazy.tensors.record(name).name == name  # type: ignore[attr-defined]


def test_lazy_records_hold_raw_codes() -> None:
    """The node's device decoder reads ``record(name).codes`` as packed codes: a zstd-coded
    record is held decompressed (checked once), a raw one as it came."""
    lazy = read_payload(ZSTD, ZSTD_MODEL, lazy=True)
    w, b = lazy.tensors.record("w"), lazy.tensors.record("b")  # type: ignore[attr-defined]
    assert (w.codes, w.codes_zstd) == (ZSTD_RAW, False)
    assert not b.codes_zstd and len(b.codes) == 1
    eager = read_payload(ZSTD, ZSTD_MODEL)
    assert torch.equal(lazy.tensors["w"].codes, eager.tensors["w"].codes)


def test_a_bad_last_frame_is_still_rejected_up_front() -> None:
    # "w" is the last tensor; its frame holds codes with the padding bits set.
    bad = with_stored_codes(ref.zstd_frame(ZSTD_RAW[:-1] + b"\x0f"))
    assert len(ZSTD_RAW) == ZSTD_RAW_SIZE
    with pytest.raises(PayloadError, match=r"tensors\[1\]\.codes"):
        read_payload(bad, ZSTD_MODEL, lazy=True)


@pytest.mark.parametrize("tile,topk", [(64, 64), (8, 5), (7, 3)])
def test_lazy_positions_expand_to_the_eager_indices_on_odd_geometries(tile: int, topk: int) -> None:
    # The check keeps in-tile positions; a lookup expands them through a one-tile offset
    # table. Tiles of one row, of odd sizes and of a whole small tensor must give the same
    # indices as the eager walk.
    shapes = {"a": (5, 7, 3), "b": (13,), "c": (96, 40), "d": (), "e": (3, 130), "f": (1, 1)}
    gen = torch.Generator().manual_seed(11)
    x = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    data = encode(x, topk=topk, tile=tile)[0]
    eager = read_payload(data, shapes)
    lazy = read_payload(data, shapes, lazy=True)
    for name in shapes:
        assert torch.equal(lazy.tensors[name].index, eager.tensors[name].index), name
        assert lazy.tensors[name].index.dtype == eager.tensors[name].index.dtype
        assert torch.equal(lazy.tensors[name].codes, eager.tensors[name].codes), name
