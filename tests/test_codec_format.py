"""The codec's header fields and wire layout, read with the independent reader in
``support.reference_codec``: every header field round-trips at its limits, and each tensor
record (shape, statistics, packed codes, Rice-coded positions) is exactly what the spec says.
"""

from __future__ import annotations

import pytest
import torch

from protocol.codec import encode, read_payload
from protocol.envelope import wrap_body
from protocol.errors import PayloadError
from support import reference_codec as ref

# ---- header fields --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        {"run_id": "", "round": 0, "node_id": "", "base": ""},
        {"run_id": "run-1", "round": 12345, "node_id": "node-α✓", "base": "ab" * 32},
        {"run_id": "r" * 256, "round": 2**63 - 1, "node_id": "n" * 256, "base": "b" * 256},
    ],
    ids=["empty", "typical", "limits"],
)
@pytest.mark.parametrize(("topk", "tile"), [(64, 64), (5, 8), (1, 1)])
def test_header_fields_round_trip(header: dict, topk: int, tile: int) -> None:
    x = {"w": torch.randn(16, 24, generator=torch.Generator().manual_seed(1))}
    payload, _ = encode(x, topk=topk, tile=tile, **header)
    p = read_payload(payload, {"w": (16, 24)})
    assert (p.run_id, p.round, p.node_id, p.base) == (
        header["run_id"],
        header["round"],
        header["node_id"],
        header["base"],
    )
    assert (p.topk, p.tile) == (topk, tile)
    assert read_payload(payload, {"w": (16, 24)}, topk=topk, tile=tile).topk == topk
    with pytest.raises(PayloadError) as err:
        read_payload(payload, {"w": (16, 24)}, topk=topk + 1)
    assert err.value.field == "body.topk"
    with pytest.raises(PayloadError) as err:
        read_payload(payload, {"w": (16, 24)}, tile=tile + 1)
    assert err.value.field == "body.tile"


# ---- the wire layout, read independently ----------------------------------------------------


@pytest.mark.parametrize(
    ("tensors", "topk", "tile"),
    [
        ({"w": (64, 64), "b": (100,)}, 64, 64),
        ({"t": (3, 5, 7), "s": ()}, 5, 8),
        ({"m": (96, 130)}, 128, 64),
        ({"one": torch.ones(64, 64)}, 64, 64),  # compresses: zstd path
    ],
)
def test_wire_layout_matches_the_spec(tensors: dict, topk: int, tile: int) -> None:
    g = torch.Generator().manual_seed(5)
    xs = {
        n: v if isinstance(v, torch.Tensor) else torch.randn(v, generator=g)
        for n, v in tensors.items()
    }
    payload, _ = encode(xs, topk=topk, tile=tile, run_id="r", round=3, node_id="n", base="f")
    version, flags, body = ref.split_payload(payload)
    assert version == 1
    assert flags in (0, 1)
    assert set(body) == {"run", "round", "node", "base", "tile", "topk", "tensors"}
    assert (body["run"], body["round"], body["node"], body["base"]) == ("r", 3, "n", "f")
    assert (body["tile"], body["topk"]) == (tile, topk)
    # The body is stored compressed exactly when that is smaller.
    raw = ref.build_payload(body)
    assert len(payload) <= len(raw)
    assert (flags == 1) == (len(payload) < len(raw))
    model = {n: tuple(x.shape) for n, x in xs.items()}
    sparse = read_payload(payload, model)
    assert [rec[0] for rec in body["tensors"]] == sorted(xs)
    for rec in body["tensors"]:
        name, shape, b, stats, codes, unary, rem = rec
        st_ = sparse.tensors[name]
        geo = st_.geometry
        assert shape == list(xs[name].shape)
        assert len(stats) == 20
        assert codes == ref.pack_codes([int(c) for c in st_.codes.tolist()])
        positions = st_.positions.tolist()
        assert ref.decode_positions(b, unary, rem, n_tiles=geo.n_tiles, k=geo.k) == positions
        gaps = ref.gaps_of(positions)
        assert (unary, rem) == ref.rice_streams(gaps, b)
        # The Rice parameter minimises the coded size (the smallest b on ties).
        costs = [sum(g_ >> c for g_ in gaps) + len(gaps) * (c + 1) for c in range(21)]
        assert b == costs.index(min(costs))
    # wrap_body builds the same header as the independent builder.
    assert wrap_body(payload[10:], flags) == payload
