"""The outer step: aggregation against a slow dense reference, determinism, error feedback."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from node.compute.outer import (
    AggregateOptions,
    add_back,
    aggregate_tensor,
    apply_aggregate,
    clip_scales,
    compress,
    feed_error,
    pseudo_gradient,
)
from protocol.codec import Payload, encode, read_payload

SHAPES = {"emb": (128, 64), "mlp": (64, 192), "norm": (64,), "odd": (7, 130)}


def make_payloads(
    n: int, seed: int = 0, scale_of: dict[int, float] | None = None
) -> dict[str, Payload]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(n):
        s = (scale_of or {}).get(i, 1.0)
        tensors = {k: torch.randn(v, generator=gen) * s for k, v in SHAPES.items()}
        data, _ = encode(tensors, topk=64, tile=64, node_id=f"node-{i:02d}")
        out[f"node-{i:02d}"] = read_payload(data, SHAPES)
    return out


def reference_aggregate(payloads: dict[str, Payload], name: str, clip: bool) -> torch.Tensor:
    """Dense, obvious: one dense copy per peer, then per-coordinate mean over contributors."""
    peers = [payloads[k] for k in sorted(payloads)]
    dense = [p.tensors[name].dense() for p in peers]
    masks = []
    for p in peers:
        m = torch.zeros(p.tensors[name].geometry.numel, dtype=torch.float32)
        m[p.tensors[name].geometry.flat_index(p.tensors[name].positions)] = 1.0
        masks.append(m.view(dense[0].shape))
    if clip:
        norms = [float(torch.linalg.vector_norm(d.double())) for d in dense]
        med = statistics.median(norms)
        dense = [
            d * torch.tensor(min(1.0, med / n) if n else 1.0)
            for d, n in zip(dense, norms, strict=True)
        ]
    sums = torch.zeros_like(dense[0])
    counts = torch.zeros_like(dense[0])
    for d, m in zip(dense, masks, strict=True):
        sums = sums + d * m
        counts = counts + m
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("n_peers", [1, 2, 5])
def test_aggregate_matches_dense_reference(n_peers: int, clip: bool) -> None:
    payloads = make_payloads(n_peers, seed=n_peers, scale_of={0: 30.0})
    peers = [payloads[k] for k in sorted(payloads)]
    for name in SHAPES:
        got = aggregate_tensor([p.tensors[name] for p in peers], clip=clip)
        want = reference_aggregate(payloads, name, clip)
        assert got.shape == SHAPES[name]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_unselected_coordinates_are_zero_and_selected_mean_over_contributors() -> None:
    payloads = make_payloads(3)
    peers = [payloads[k] for k in sorted(payloads)]
    parts = [p.tensors["mlp"] for p in peers]
    agg = aggregate_tensor(parts, clip=False).reshape(-1)
    chosen = torch.zeros_like(agg, dtype=torch.bool)
    for p in parts:
        chosen[p.geometry.flat_index(p.positions)] = True
    assert bool((agg[~chosen] == 0).all())
    # A coordinate chosen by exactly one peer carries that peer's value, not a third of it.
    only0 = parts[0].geometry.flat_index(parts[0].positions)
    others = torch.cat([p.geometry.flat_index(p.positions) for p in parts[1:]])
    solo = only0[~torch.isin(only0, others)]
    assert solo.numel() > 0
    torch.testing.assert_close(agg[solo], parts[0].dense().reshape(-1)[solo], rtol=0, atol=0)


def test_bit_identical_whatever_the_arrival_order() -> None:
    payloads = make_payloads(6, seed=3)
    results = []
    for trial in range(4):
        keys = list(payloads)
        random.Random(trial).shuffle(keys)
        params = {k: torch.ones(v) for k, v in SHAPES.items()}
        apply_aggregate(
            params, {k: payloads[k] for k in keys}, AggregateOptions(alpha=0.7, clip=True)
        )
        results.append(params)
    for other in results[1:]:
        for name in SHAPES:
            assert torch.equal(results[0][name].view(torch.int32), other[name].view(torch.int32))


def test_apply_is_theta_minus_alpha_times_aggregate() -> None:
    payloads = make_payloads(3, seed=4)
    peers = [payloads[k] for k in sorted(payloads)]
    params = {k: torch.full(v, 0.5) for k, v in SHAPES.items()}
    apply_aggregate(params, payloads, AggregateOptions(alpha=0.5, clip=False))
    for name in SHAPES:
        agg = aggregate_tensor([p.tensors[name] for p in peers], clip=False)
        assert torch.equal(params[name], torch.full(SHAPES[name], 0.5) - agg * 0.5)


def test_empty_round_leaves_parameters_unchanged() -> None:
    params = {k: torch.randn(v) for k, v in SHAPES.items()}
    before = {k: v.clone() for k, v in params.items()}
    apply_aggregate(params, {})
    assert all(torch.equal(params[k], before[k]) for k in SHAPES)


def test_clip_scales_bring_outliers_to_the_median_norm() -> None:
    payloads = make_payloads(5, seed=5, scale_of={2: 1000.0})
    parts = [payloads[k].tensors["emb"] for k in sorted(payloads)]
    scales = clip_scales(parts)
    norms = [p.sq_norm() ** 0.5 for p in parts]
    med = statistics.median(norms)
    assert scales[2] < 0.01
    assert scales[2] * norms[2] == pytest.approx(med, rel=1e-12)
    assert all(s == 1.0 for i, s in enumerate(scales) if norms[i] <= med)


def test_sq_norm_is_exact_against_float64_dense() -> None:
    payload = make_payloads(1, seed=6)["node-00"]
    for t in payload.tensors.values():
        dense = t.dense().double()
        assert t.sq_norm() == pytest.approx(float((dense * dense).sum()), rel=1e-12)


def test_error_feedback_cycle_conserves_mass() -> None:
    gen = torch.Generator().manual_seed(7)
    start = {k: torch.randn(v, generator=gen) for k, v in SHAPES.items()}
    trained = {k: t - 0.01 * torch.randn(t.shape, generator=gen) for k, t in start.items()}
    error = {k: 0.1 * torch.randn(v, generator=gen) for k, v in SHAPES.items()}
    delta = pseudo_gradient(start, trained)
    feed_error(error, delta, beta=0.95)
    computed = {k: v.clone() for k, v in error.items()}
    data, recon = compress(error, topk=64, tile=64)
    assert isinstance(data, bytes) and data
    for k in SHAPES:
        # sent + held = what was computed (up to one rounding of the subtraction)
        torch.testing.assert_close(error[k] + recon[k], computed[k], rtol=0, atol=1e-6)
        assert float((recon[k] != 0).float().mean()) < 0.1
    add_back(error, recon)
    for k in SHAPES:
        torch.testing.assert_close(error[k], computed[k], rtol=0, atol=1e-6)


def test_feed_error_is_beta_e_plus_delta() -> None:
    e = {"a": torch.tensor([1.0, -2.0])}
    feed_error(e, {"a": torch.tensor([0.5, 0.5])}, beta=0.5)
    assert torch.equal(e["a"], torch.tensor([1.0, -0.5]))


def test_peers_must_share_the_tile_grid() -> None:
    """Peers may keep fewer entries per tile (a thin link), never cut tiles differently."""
    gen = torch.Generator().manual_seed(8)
    a, _ = encode({"w": torch.randn(64, 64, generator=gen)}, topk=64, tile=64)
    b, _ = encode({"w": torch.randn(64, 64, generator=gen)}, topk=16, tile=32)
    pa, pb = read_payload(a, {"w": (64, 64)}), read_payload(b, {"w": (64, 64)})
    with pytest.raises(ValueError, match="geometry"):
        aggregate_tensor([pa.tensors["w"], pb.tensors["w"]])
