"""The link's own terms in the projection (``node.research.bench.wire``, issue 20): pure
arithmetic, no network. Properties rather than digits: a longer round trip costs at least its
round trips, a link without delay adds nothing, resets only ever cost time."""

from __future__ import annotations

import math

import pytest

from node.research.bench.projection import Assumptions, Row, on_link, project
from node.research.bench.wire import (
    INIT_WINDOW_BYTES,
    OVERLAP_PATH_RTTS,
    PLAIN_REQUEST_RTTS,
    Link,
    bytes_s,
    reset_s,
    slow_start_s,
    store_round,
)

HOME = Link(name="home", up_mbit=20, down_mbit=100, rtt_ms=40)
OFFICE = Link(name="office", up_mbit=100, down_mbit=100, rtt_ms=20)
FAR = Link(name="far", up_mbit=50, down_mbit=50, rtt_ms=150, jitter_ms=30)
FLAKY = HOME.model_copy(update={"name": "flaky", "reset_every_s": 60.0})
#: A 10.8 M-parameter payload (docs/benchmarks.md §17's larger model), three peers.
PAYLOAD, PEERS = 183e3, 3


def _round(link: Link, **kw: float) -> tuple[float, float]:
    inputs = {"train_s": 1.3, "work_s": 0.3, "path_s": 0.28, "payload": PAYLOAD} | kw
    _, plain, overlap = on_link(link, peers=PEERS, **inputs)  # type: ignore[arg-type]
    return plain, overlap


def test_a_link_without_delay_adds_nothing_but_bytes() -> None:
    flat = Link.symmetric(100.0)
    wire = store_round(flat, PAYLOAD, PEERS)
    assert (wire.requests_s, wire.slow_start_s) == (0.0, 0.0)
    assert wire.comm_s == pytest.approx(bytes_s(PAYLOAD, 100) * (1 + PEERS))
    plain, overlap = _round(flat)
    assert plain == pytest.approx(1.3 + 0.3 + wire.comm_s)
    assert overlap == pytest.approx(max(1.3, wire.comm_s) + 0.28)


def test_asymmetric_rates_price_each_direction_at_its_own_rate() -> None:
    wire = store_round(HOME, PAYLOAD, PEERS)
    assert wire.up_s == pytest.approx(PAYLOAD * 8 / 20e6)
    assert wire.down_s == pytest.approx(PEERS * PAYLOAD * 8 / 100e6)


def test_far_exceeds_office_by_at_least_its_extra_round_trips() -> None:
    for payload in (8e3, PAYLOAD, 64e6):
        far, office = _round(FAR, payload=payload), _round(OFFICE, payload=payload)
        trips = PLAIN_REQUEST_RTTS + math.ceil(PEERS / 8)
        assert far[0] - office[0] >= trips * (0.150 - 0.020) - 1e-9
        # Overlapped, at least the two round trips between trainings remain.
        assert far[1] - office[1] >= OVERLAP_PATH_RTTS * (0.150 - 0.020) - 1e-9


def test_slow_start_is_nothing_for_one_window_and_bounded_by_the_ramp() -> None:
    assert slow_start_s(INIT_WINDOW_BYTES, 20, 0.04) == 0.0
    assert slow_start_s(1e9, 20, 0.0) == 0.0
    for link_mbit, rtt in ((20, 0.04), (100, 0.02), (50, 0.15), (1000, 0.3)):
        ramp = math.ceil(math.log2(link_mbit * 1e6 / 8 * rtt / INIT_WINDOW_BYTES))
        for size in (3e4, 1e6, 1e8):
            extra = slow_start_s(size, link_mbit, rtt)
            assert 0.0 <= extra <= ramp * rtt
        # Past the ramp the extra no longer grows with the size.
        assert slow_start_s(1e8, link_mbit, rtt) == pytest.approx(slow_start_s(1e9, link_mbit, rtt))


def test_parallel_streams_ramp_up_no_slower_and_a_longer_rtt_costs_more() -> None:
    for size in (1e5, 1e6, 1e7):
        assert slow_start_s(size, 100, 0.15, streams=8) <= slow_start_s(size, 100, 0.15)
        assert slow_start_s(size, 50, 0.15) >= slow_start_s(size, 50, 0.02)


def test_resets_only_cost_and_cost_more_the_more_often() -> None:
    home, flaky = _round(HOME), _round(FLAKY)
    often = _round(FLAKY.model_copy(update={"reset_every_s": 5.0}))
    assert flaky[0] > home[0] and flaky[1] >= home[1]  # overlapped, hidden beside training
    assert often[0] > flaky[0]
    slow = _round(FLAKY, train_s=0.1)  # ... unless the transfers are the longer branch
    assert slow[1] > _round(HOME, train_s=0.1)[1]
    # Once a minute per node, three nodes, a round of about two seconds: hundredths of a second.
    assert flaky[0] - home[0] < 0.1


def test_a_round_waits_for_any_of_its_nodes_reset_but_not_for_all_their_resets_added() -> None:
    wire = store_round(FLAKY, PAYLOAD, PEERS)
    one = reset_s(FLAKY, wire, 2.0, PAYLOAD, nodes=1)
    for n in (2, 4, 16):
        many = reset_s(FLAKY, wire, 2.0, PAYLOAD, nodes=n)
        assert one < many < n * one  # rare resets: nearly n times one node's
        assert many == pytest.approx(n * one, rel=0.03 * n)
    often = FLAKY.model_copy(update={"reset_every_s": 0.01})  # every node hit every round
    assert reset_s(often, wire, 2.0, PAYLOAD, nodes=16) == pytest.approx(
        reset_s(often, wire, 2.0, PAYLOAD, nodes=1)
    )


def test_overlap_never_slower_than_plain_on_any_link() -> None:
    for link in (HOME, OFFICE, FAR, FLAKY):
        for payload in (8e3, PAYLOAD, 64e6):
            plain, overlap = _round(link, payload=payload)
            assert overlap <= plain


def test_dense_ring_pays_a_round_trip_per_hop_and_ddp_one_ring_per_step() -> None:
    a = Assumptions(sizes=(1e9,), peers=4, inner_steps=10)
    flat = Link(name="flat", up_mbit=50, down_mbit=50)
    flat_rows: dict[str, Row] = {r.method: r for r in project(a, [flat])}
    far_rows: dict[str, Row] = {r.method: r for r in project(a, [FAR])}
    hops = 2 * (4 - 1) * 0.150
    ring, ddp = "DiLoCo fp32, ring all-reduce", "DDP bf16, all-reduce per step"
    assert far_rows[ring].comm_s - flat_rows[ring].comm_s == pytest.approx(hops)
    assert far_rows[ddp].comm_s - flat_rows[ddp].comm_s == pytest.approx(10 * hops)
    for method, row in far_rows.items():
        assert row.round_s >= flat_rows[method].round_s


def test_the_round_trips_counted_by_hand() -> None:
    """One window each way (no slow start), 1 MB/s, 100 ms: a plain round waits for 6 round
    trips and one wave of GETs; overlapped, 5 of them and the wave travel beside training and
    2 stand between two trainings."""
    link = Link(name="hand", up_mbit=8, down_mbit=8, rtt_ms=100)
    wire = store_round(link, 1000.0, PEERS)
    assert wire.slow_start_s == 0.0 and wire.requests_s == pytest.approx(0.7)
    bytes_ = 0.001 + PEERS * 0.001
    _, plain, overlap = on_link(
        link, train_s=2.0, work_s=0.3, path_s=0.2, payload=1000.0, peers=PEERS
    )
    assert plain == pytest.approx(2.0 + 0.3 + 0.7 + bytes_)
    assert overlap == pytest.approx(2.0 + 0.2 + 0.2)  # training is the longer branch
    _, _, short = on_link(link, train_s=0.1, work_s=0.3, path_s=0.2, payload=1000.0, peers=PEERS)
    assert short == pytest.approx(0.6 + bytes_ + 0.2 + 0.2)  # the transfers' chain is
