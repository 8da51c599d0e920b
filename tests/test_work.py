"""Unequal work: the rules that weigh peers by their steps, the bound on a claim, peers that keep
fewer entries per tile, and the screening of honest peers that did less."""

from __future__ import annotations

import statistics

import pytest
import torch

from node.compute.outer import AggregateOptions, aggregate_tensor, apply_aggregate
from node.compute.robust import Screening
from node.compute.work import RULES, UNIT, PeerWeight, claimed, peer_weights, work_shares
from protocol.codec import Payload, encode, read_payload

SHAPES = {"emb": (128, 64), "mlp": (64, 192), "norm": (64,), "odd": (7, 130)}
H = 30


def _payloads(topks: list[int], seed: int = 0) -> dict[str, Payload]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, topk in enumerate(topks):
        tensors = {k: torch.randn(v, generator=gen) for k, v in SHAPES.items()}
        data, _ = encode(tensors, topk=topk, tile=64, node_id=f"node-{i}", steps=H)
        out[f"node-{i}"] = read_payload(data, SHAPES, topk=64, tile=64)
    return out


def _reference(
    payloads: dict[str, Payload], name: str, weights: dict[str, PeerWeight] | None
) -> torch.Tensor:
    """Dense and obvious, in float64: scale, clip to the median norm, weight, then the mean of
    each entry over the peers that selected it."""
    ids = sorted(payloads)
    dense, masks, norms = [], [], []
    for n in ids:
        t = payloads[n].tensors[name]
        w = (weights or {}).get(n, UNIT)
        d = t.dense().double() * w.pre
        m = torch.zeros(t.geometry.numel, dtype=torch.float64)
        m[t.geometry.flat_index(t.positions)] = 1.0
        dense.append(d)
        masks.append(m.view(d.shape))
        norms.append(float(torch.linalg.vector_norm(d)))
    med = statistics.median(norms)
    sums = torch.zeros_like(dense[0])
    counts = torch.zeros_like(dense[0])
    for n, d, m, norm in zip(ids, dense, masks, norms, strict=True):
        w = (weights or {}).get(n, UNIT)
        scale = min(1.0, med / norm) if norm else 1.0
        sums += d * scale * m * w.post
        counts += m * w.post
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums)).float()


# ---- the rules -------------------------------------------------------------------------------


def test_claims_are_clamped_to_one_to_h() -> None:
    assert [claimed(s, H) for s in (None, 0, 1, 7, H, H + 1, 10**9)] == [H, H, 1, 7, H, H, H]


def test_equal_work_counts_every_peer_once_whatever_the_rule() -> None:
    for rule in RULES:
        assert peer_weights({"a": 10, "b": 10, "c": 10}, H, rule) is None
    assert peer_weights({"a": 10, "b": 3}, H, "mean") is None


def test_steps_weights_are_integers_without_a_common_factor() -> None:
    got = peer_weights({"a": H, "b": 20, "c": 10}, H, "steps")
    assert got == {"a": PeerWeight(post=3), "b": PeerWeight(post=2), "c": PeerWeight(post=1)}
    got = peer_weights({"a": 10, "b": 5}, H, "per_step")
    assert got == {"a": PeerWeight(pre=3.0), "b": PeerWeight(pre=6.0)}


def test_work_shares_add_up_to_one() -> None:
    shares = work_shares({"a": H, "b": 10, "c": None}, H)
    assert shares == pytest.approx({"a": 3 / 7, "b": 1 / 7, "c": 3 / 7})


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown work rule"):
        peer_weights({"a": 1, "b": 2}, H, "tokens")  # type: ignore[arg-type]


# ---- aggregation of unequal work --------------------------------------------------------------


@pytest.mark.parametrize(
    "topks", [[64, 64, 64], [64, 16, 64, 1], [5, 64]], ids=["equal", "mixed", "two"]
)
@pytest.mark.parametrize("rule", RULES)
def test_weighted_mean_of_mixed_k_matches_the_dense_reference(topks: list[int], rule) -> None:
    payloads = _payloads(topks, seed=len(topks))
    steps = {n: [H, 10, 25, 3][i] for i, n in enumerate(sorted(payloads))}
    weights = peer_weights(steps, H, rule)
    peers = [payloads[n] for n in sorted(payloads)]
    row = None if weights is None else [weights[n] for n in sorted(payloads)]
    for name in SHAPES:
        got = aggregate_tensor([p.tensors[name] for p in peers], clip=True, weights=row)
        torch.testing.assert_close(got, _reference(payloads, name, weights), rtol=1e-5, atol=1e-6)


def test_weights_of_one_are_bit_for_bit_the_plain_mean() -> None:
    payloads = _payloads([64, 64, 32, 64])
    ones = {n: PeerWeight() for n in payloads}
    a = {n: torch.zeros(s) for n, s in SHAPES.items()}
    b = {n: torch.zeros(s) for n, s in SHAPES.items()}
    options = AggregateOptions(clip=True, robust=True)
    apply_aggregate(a, payloads, options)
    apply_aggregate(b, payloads, options, work=ones)
    assert all(torch.equal(a[n], b[n]) for n in SHAPES)


def test_weighted_aggregation_is_the_same_bits_whatever_the_arrival_order() -> None:
    payloads = _payloads([64, 16, 64, 64, 8], seed=3)
    work = peer_weights(
        {n: s for n, s in zip(sorted(payloads), [30, 7, 12, 30, 2], strict=True)}, H, "steps"
    )
    results = []
    for order in (sorted(payloads), sorted(payloads, reverse=True)):
        theta = {n: torch.ones(s) for n, s in SHAPES.items()}
        apply_aggregate(theta, {n: payloads[n] for n in order}, AggregateOptions(robust=True), work)
        results.append(theta)
    assert all(torch.equal(results[0][n], results[1][n]) for n in SHAPES)


def test_a_claim_buys_at_most_a_full_nodes_weight() -> None:
    """A peer that claims more steps than H (or H while it ran one) counts as an honest full
    peer at most: under "steps" its pull on an entry is never more than under the plain mean."""
    payloads = _payloads([64, 64, 64])
    liar = "node-2"
    honest = {"node-0": H, "node-1": 10}
    for claim in (H, 10 * H, 2**31):
        weights = peer_weights({**honest, liar: claim}, H, "steps")
        assert weights is not None
        assert weights[liar].post == max(w.post for w in weights.values())
        assert weights[liar] == peer_weights({**honest, liar: H}, H, "steps")[liar]  # type: ignore[index]
    # The bound in values: with the liar's claim the aggregate moves towards it by no more
    # than the plain mean (every peer once) moves it where the honest ones did less.
    ids = sorted(payloads)
    parts = [payloads[n].tensors["mlp"] for n in ids]
    row = [peer_weights({**honest, liar: 10 * H}, H, "steps")[n] for n in ids]  # type: ignore[index]
    liar_dense = payloads[liar].tensors["mlp"].dense()
    weighted = aggregate_tensor(parts, clip=False, weights=row)
    plain_full = aggregate_tensor(parts, clip=False, weights=[PeerWeight(post=1)] * 3)
    only_liar = torch.zeros_like(liar_dense, dtype=torch.bool)
    others = torch.zeros_like(only_liar)
    for n, p in zip(ids, parts, strict=True):
        m = torch.zeros(p.geometry.numel, dtype=torch.bool)
        m[p.geometry.flat_index(p.positions)] = True
        if n == liar:
            only_liar |= m.view(only_liar.shape)
        else:
            others |= m.view(only_liar.shape)
    alone = only_liar & ~others
    # Entries only the liar selected get its value, as under the plain mean: nothing more
    # (to the rounding of w·v / w in fp32).
    assert alone.any()
    torch.testing.assert_close(weighted[alone], plain_full[alone], rtol=1e-6, atol=0.0)


def test_per_step_scaling_stays_within_the_median_norm_with_clipping() -> None:
    payloads = _payloads([64, 64, 64, 64])
    ids = sorted(payloads)
    weights = peer_weights({ids[0]: 1, ids[1]: H, ids[2]: H, ids[3]: H}, H, "per_step")
    assert weights is not None and weights[ids[0]].pre == H
    parts = [payloads[n].tensors["mlp"] for n in ids]
    norms = [float(torch.linalg.vector_norm(p.dense())) for p in parts]
    # Alone, the scaled-up peer's contribution is its tensor clipped back to the median norm.
    from node.compute.outer import _peer_tables

    tables = _peer_tables(parts, True, False, weights=[weights[n] for n in ids])
    scaled = parts[0].table * H
    factor = tables[0] / scaled.numpy()
    got_norm = norms[0] * H * float(factor.max())
    assert got_norm <= statistics.median([norms[0] * H, *norms[1:]]) * (1 + 1e-5)


# ---- screening does not hold less work against a node ----------------------------------------


def test_a_clean_round_of_unequal_work_screens_nobody() -> None:
    """Honest nodes that trained 30, 30, 30 and 10 steps (the slow one's update a third, and
    noisier): none is screened, under any k it sends."""
    gen = torch.Generator().manual_seed(11)
    shared = {k: torch.randn(v, generator=gen) for k, v in SHAPES.items()}
    payloads = {}
    for i, (steps, topk) in enumerate([(30, 64), (30, 64), (30, 64), (10, 64), (10, 16)]):
        own = {k: torch.randn(v, generator=gen) for k, v in SHAPES.items()}
        # The steps' shared direction plus noise of a run that long: less work, more noise.
        x = {k: steps * shared[k] + (steps**0.5) * 3 * own[k] for k in SHAPES}
        data, _ = encode(x, topk=topk, tile=64, node_id=f"n{i}", steps=steps)
        payloads[f"n{i}"] = read_payload(data, SHAPES, topk=64)
    theta = {n: torch.zeros(s) for n, s in SHAPES.items()}
    work = peer_weights({n: p.steps for n, p in payloads.items()}, H, "steps")
    screening: Screening = apply_aggregate(theta, payloads, AggregateOptions(robust=True), work)
    assert screening.rejected == {}
