"""How a node fits a round into its budget (``node.compute.linkbudget``): training time, the
entries per tile a thin link sends, and when it only observes."""

from __future__ import annotations

import pytest
import torch

from node.compute.linkbudget import (
    LINK_SHARE,
    MARGIN_S,
    MARGIN_SHARE,
    LinkMeter,
    bits_per_entry,
    payload_bytes,
    plan,
)
from protocol.codec import encode
from protocol.payload_index import PREFIX

TOPK, TILE = 64, 64


def meter(bytes_per_s: float) -> LinkMeter:
    m = LinkMeter()
    m.uploaded(1_000_000, 1_000_000 / bytes_per_s)
    return m


def margin(left: float) -> float:
    return max(MARGIN_S, MARGIN_SHARE * left)


def test_without_a_budget_or_measurements_nothing_is_cut() -> None:
    assert plan(None, topk=TOPK, tile=TILE, payload_size=10, encode_s=0.1, meter=meter(1e6)) == (
        plan(None, topk=TOPK, tile=TILE, payload_size=None, encode_s=0.0, meter=LinkMeter())
    )
    first = plan(None, topk=TOPK, tile=TILE, payload_size=None, encode_s=0, meter=LinkMeter())
    assert first.train_s is None and first.topk == TOPK and first.cut is None
    # A budget but no upload measured yet (a node's first round with one): time only.
    only = plan(10.0, topk=TOPK, tile=TILE, payload_size=None, encode_s=0.5, meter=LinkMeter())
    assert only.topk == TOPK and only.train_s == pytest.approx(10.0 - 0.5 - margin(10.0))


def test_a_fast_link_trains_until_the_upload_must_start() -> None:
    # 10 s left, 1 MB payload at 10 MB/s: 0.1 s up, 0.2 s encode, and the margin.
    p = plan(10.0, topk=TOPK, tile=TILE, payload_size=1_000_000, encode_s=0.2, meter=meter(1e7))
    assert p.topk == TOPK and p.cut == "compute"
    assert p.train_s == pytest.approx(10.0 - 0.2 - margin(10.0) - 0.1)
    assert p.upload_s == pytest.approx(0.1)


def test_a_thin_link_sends_fewer_entries_per_tile_within_its_share() -> None:
    # 10 s left; the whole payload takes 20 s up: k drops until its upload fits the share.
    p = plan(10.0, topk=TOPK, tile=TILE, payload_size=1_000_000, encode_s=0.0, meter=meter(5e4))
    left = 10.0 - margin(10.0)
    assert p.cut == "link" and 1 <= p.topk < TOPK
    assert p.upload_s <= LINK_SHARE * left
    bigger = meter(5e4).upload_s(payload_bytes(1_000_000, TOPK, p.topk + 1, TILE))
    assert bigger is not None and bigger > LINK_SHARE * left  # the largest k that fits
    assert p.train_s == pytest.approx(left - p.upload_s)


def test_a_link_that_cannot_carry_one_entry_per_tile_observes() -> None:
    p = plan(10.0, topk=TOPK, tile=TILE, payload_size=10**9, encode_s=0.0, meter=meter(1e4))
    assert p.observing and p.train_s == 0.0


def test_payload_size_estimate_follows_the_real_encoder() -> None:
    """The estimate of a payload at k' from one at k is within 10 % of what the codec writes."""
    x = {
        f"w{i}": torch.randn(256, 256, generator=torch.Generator().manual_seed(i)) for i in range(4)
    }
    full, _ = encode(x, topk=TOPK, tile=TILE)
    header = PREFIX.size + PREFIX.unpack_from(full)[3]
    for k in (1, 4, 16, 32):
        real, _ = encode(x, topk=k, tile=TILE)
        estimate = payload_bytes(len(full), TOPK, k, TILE, header)
        assert abs(estimate - len(real)) <= 0.1 * len(real), (k, estimate, len(real))
    assert bits_per_entry(64, 4096) == pytest.approx(7.36 + 2, abs=0.05)  # DESIGN.md's bound


def test_a_small_upload_that_went_through_at_once_says_nothing_of_a_whole_payload() -> None:
    """A link with a burst: the whole payload took 30 s, a quarter of it 0.1 s. A whole one is
    still predicted at 30 s; a quarter-size one at the quarter's own pace."""
    m = LinkMeter()
    m.uploaded(200_000, 30.0)
    for _ in range(5):
        m.uploaded(50_000, 0.1)
    assert m.upload_s(200_000) == pytest.approx(30.0)
    assert m.upload_s(50_000) == pytest.approx(7.5)  # the 200 kB upload is alike enough (≥ P/2)
    assert m.upload_s(20_000) == pytest.approx(3.0)
    fresh = LinkMeter()
    fresh.uploaded(50_000, 0.1)
    assert fresh.upload_s(200_000) == pytest.approx(0.4)  # nothing larger seen: all it has


def test_a_short_upload_never_sends_fewer_entries_per_tile() -> None:
    """A tiny round (1 s left) over a fast link whose 3 kB upload took 0.1 s (round trips, not
    bytes): the node trains less; it does not cut k to 1 for a payload that is quick anyway."""
    m = LinkMeter()
    m.uploaded(3000, 0.1)
    p = plan(1.0, topk=TOPK, tile=TILE, payload_size=3000, encode_s=0.05, meter=m)
    assert p.topk == TOPK and p.cut == "compute"
    assert p.train_s == pytest.approx(max(0.0, 1.0 - 0.05 - margin(1.0) - 0.1))


def test_what_cut_a_round_is_said_as_the_plan_made_it() -> None:
    from node.compute.linkbudget import Plan
    from node.compute.worker import TrainResult
    from node.daemon.budgeting import cut_of

    def result(steps: int, topk: int) -> TrainResult:
        return TrainResult(b"", "", "", {}, 0.0, 0.0, 0.0, steps=steps, topk=topk)

    H = 8
    assert cut_of(Plan(None, TOPK), result(H, TOPK), H, observing=False) is None
    assert cut_of(Plan(1.0, TOPK, "compute"), result(3, TOPK), H, observing=False) == "compute"
    assert cut_of(Plan(1.0, 5, "link"), result(3, 5), H, observing=False) == "link"
    # A node that starts a round late finds not even one entry per tile fits in what is left
    # (though it would in a whole budget): it sends one entry per tile after a single step,
    # and it was its link that cut the round, not its compute (seen in the WAN lab's round 1).
    late = plan(2.0, topk=TOPK, tile=TILE, payload_size=200_000, encode_s=0.1, meter=meter(1e3))
    assert late.observing and late.topk == 1
    assert cut_of(late, result(1, 1), H, observing=False) == "link"
    assert cut_of(late, result(1, 1), H, observing=True) == "observing"
