"""Robust aggregation (``node.compute.robust``), in process and fast.

Honest peers are stand-ins for error-feedback buffers that share a direction (a common
component plus each peer's own noise, as pseudo-gradients of one model on different data do);
hostile peers are the attacks of ``node.research.bench.hostile``. Checked: an honest round
screens nobody and aggregates exactly as without screening; every attack is screened out and the
result is bit for bit what the honest peers alone give; colluding attackers cannot vouch for
each other; verdicts do not depend on the order payloads arrive in; two peers are never judged;
and the value bound caps what one peer can do when screening cannot act.
"""

from __future__ import annotations

import math

import pytest
import torch

from node.compute.outer import AggregateOptions, apply_aggregate, sparse_mean
from node.compute.robust import VALUE_BOUND
from protocol.codec import Payload, encode, read_payload

#: The tiny model's tensor shapes (two blocks).
SHAPES = {
    "emb": (256, 64),
    "pos": (64, 64),
    **{
        f"b{b}.{name}": shape
        for b in range(2)
        for name, shape in (
            ("ln1", (64,)),
            ("qkv", (192, 64)),
            ("proj", (64, 64)),
            ("ln2", (64,)),
            ("up", (256, 64)),
            ("w", (64, 256)),
        )
    },
    "ln_f": (64,),
}


def _buffer(seed: int, common: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: common[n] + 0.3 * torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _common(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _payload(node: str, tensors: dict[str, torch.Tensor]) -> Payload:
    data, _ = encode(tensors, topk=64, tile=64, node_id=node)
    return read_payload(data, SHAPES, lazy=True)


def _hostile(
    kind: str, honest: dict[str, torch.Tensor], seed: int = 999
) -> dict[str, torch.Tensor]:
    rms = {n: float(t.pow(2).mean().sqrt()) for n, t in honest.items()}
    if kind == "sign_flip":
        return {n: -t for n, t in honest.items()}
    if kind == "noise":
        g = torch.Generator().manual_seed(seed)
        return {n: torch.randn(t.shape, generator=g) * rms[n] for n, t in honest.items()}
    width = 64 if kind == "huge_tile" else 1
    out = {}
    for n, t in honest.items():
        flat = torch.zeros(t.numel())
        sign = torch.where(t.reshape(-1)[:width] >= 0, 1.0, -1.0)
        flat[:width] = -sign * 1e4 * rms[n]
        out[n] = flat.view(t.shape)
    return out


def _apply(payloads: dict[str, Payload], robust: bool = True) -> tuple[dict, dict[str, str]]:
    theta = {n: torch.zeros(s) for n, s in SHAPES.items()}
    screening = apply_aggregate(theta, payloads, AggregateOptions(robust=robust))
    return theta, screening.rejected


def _honest(n: int, seed: int = 0) -> dict[str, Payload]:
    common = _common(seed)
    return {f"h{i}": _payload(f"h{i}", _buffer(100 * seed + i, common)) for i in range(n)}


def test_an_honest_round_screens_nobody_and_aggregates_as_before() -> None:
    payloads = _honest(4)
    robust, rejected = _apply(payloads)
    plain, _ = _apply(payloads, robust=False)
    assert rejected == {}
    for name in SHAPES:
        assert torch.equal(robust[name], plain[name])


@pytest.mark.parametrize("kind", ["sign_flip", "noise", "huge_tile", "one_entry"])
@pytest.mark.parametrize("honest_n", [3, 6])
def test_an_attack_is_screened_and_changes_nothing(kind: str, honest_n: int) -> None:
    honest = _honest(honest_n)
    victim = _buffer(0, _common(0))
    attacked = {**honest, "zz": _payload("zz", _hostile(kind, victim))}
    theta, rejected = _apply(attacked)
    alone, _ = _apply(honest)
    assert list(rejected) == ["zz"] and rejected["zz"].startswith("screened: sign agreement")
    for name in SHAPES:
        assert torch.equal(theta[name], alone[name])  # bit for bit the honest peers' result
    without, _ = _apply(attacked, robust=False)
    assert any(not torch.equal(without[n], alone[n]) for n in SHAPES)  # the attack was real


def test_colluding_attackers_cannot_vouch_for_each_other() -> None:
    honest = _honest(6)
    victim = _buffer(0, _common(0))
    hostile = _hostile("huge_tile", victim)  # both send the same tile: they agree with each other
    attacked = {**honest, "za": _payload("za", hostile), "zb": _payload("zb", hostile)}
    _, rejected = _apply(attacked)
    assert sorted(rejected) == ["za", "zb"]


def test_verdicts_do_not_depend_on_arrival_order() -> None:
    honest = _honest(4)
    items = [*honest.items(), ("zz", _payload("zz", _hostile("noise", _buffer(0, _common()))))]
    first, rej_a = _apply(dict(items))
    second, rej_b = _apply(dict(reversed(items)))
    assert rej_a == rej_b
    for name in SHAPES:
        assert torch.equal(first[name], second[name])


def test_two_peers_are_never_judged() -> None:
    honest = _honest(1)
    pair = {**honest, "zz": _payload("zz", _hostile("sign_flip", _buffer(0, _common(0))))}
    _, rejected = _apply(pair)
    assert rejected == {}  # each is judged only by the other: nobody can tell who lies


def test_the_value_bound_caps_one_peer_where_screening_does_not_act() -> None:
    honest = _honest(3)
    victim = _buffer(0, _common(0))
    parts = [p.tensors["b0.w"] for p in honest.values()]
    parts.append(_payload("zz", _hostile("one_entry", victim)).tensors["b0.w"])
    norms = sorted(math.sqrt(p.sq_norm()) for p in parts)
    median = (norms[1] + norms[2]) / 2
    bound = VALUE_BOUND * median / math.sqrt(parts[0].geometry.n_kept)
    _, bounded = sparse_mean(parts, clip=True, bound=True)
    _, unbounded = sparse_mean(parts, clip=True, bound=False)
    assert float(bounded.abs().max()) <= bound * (1 + 1e-6)
    assert float(unbounded.abs().max()) > 2 * bound  # one entry carries a whole tensor's norm
