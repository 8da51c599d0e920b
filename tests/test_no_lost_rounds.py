"""No round is spent on nothing, with real processes: a store outage and a slowed fleet.

Real SeaweedFS, ``python -m coordinator`` and two ``python -m node`` processes (the tiny model),
with deadlines learnt tight (margin 1 s, a few seconds per round), as they are on a quiet
machine. Without holds, both faults below closed rounds with an empty gather set:

- the store stops for 60 s as round 2 opens (its deadline is a few seconds): nodes cannot
  upload, the coordinator cannot check; the round must wait and gather once the store is back;
- every node is slowed 4x (SIGSTOP/SIGCONT duty cycle, ``support.throttle``) from round 1 on,
  whose deadline was learnt from the fast round 0.

Verdicts are invariants, never times: the run closes all its rounds, every closed round gathered
at least one payload, every node that reported a round reported the same fingerprint, and every
node exits 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.cluster.seaweed import EmbeddedStore
from protocol.messages import RoundState, StatusView
from protocol.runconfig import RunConfig, Timing
from support.cluster import Cluster
from support.throttle import Throttle

TIMING = Timing(
    first_round_s=120,
    min_round_s=1,
    max_round_s=300,
    factor=2.0,
    margin_s=1.0,
    heartbeat_timeout_s=20,
)
NODES = 2
OUTAGE_S = 60.0


def _run(name: str, rounds: int) -> RunConfig:
    return RunConfig(
        name=name,
        model="tiny",
        rounds=rounds,
        inner_steps=10,
        batch_size=4,
        min_nodes=NODES,
        checkpoint_every=0,
        timing=TIMING,
    )


def _open(cluster: Cluster, round_: int) -> None:
    """Wait until ``round_`` is the open round (or further)."""

    def there(s: StatusView) -> bool:
        return s.round > round_ or (s.round == round_ and s.state != RoundState.WAITING)

    cluster.wait_for(f"round {round_} to open", there)


def _assert_no_round_lost(cluster: Cluster, status: StatusView) -> None:
    closed = [r for r in status.rounds if r.state == RoundState.CLOSED]
    assert [r.round for r in closed] == list(range(cluster.run.rounds))
    for r in closed:
        assert r.gather, f"round {r.round} closed empty: excluded {r.excluded}"
        assert len(set(r.fingerprints.values())) == 1, (r.round, r.fingerprints)


@pytest.fixture
def own_store(tmp_path: Path) -> Iterator[EmbeddedStore]:
    """A store of the test's own: it is stopped and started again."""
    store = EmbeddedStore(tmp_path / "store")
    store.start()
    try:
        yield store
    finally:
        store.stop()


def test_a_store_outage_loses_no_round(tmp_path: Path, own_store: EmbeddedStore) -> None:
    cluster = Cluster(tmp_path / "run", own_store, _run("outage", rounds=4), NODES)
    try:
        cluster.start_coordinator()
        for name in cluster.tokens:
            cluster.start_node(name)
        _open(cluster, 2)
        own_store.stop()
        until = time.monotonic() + OUTAGE_S
        while time.monotonic() < until:
            for name, proc in cluster.nodes.items():
                assert proc.poll() is None, f"{name} exited during the outage:\n{proc.tail(30)}"
            time.sleep(0.5)
        own_store.start()
        status = cluster.wait_finished()
        _assert_no_round_lost(cluster, status)
        log = (cluster.root / "logs" / "coordinator-1.log").read_text()
        assert "event=store_unreachable" in log and "event=store_reachable" in log
    finally:
        cluster.stop()


def test_a_slowed_fleet_loses_no_round(tmp_path: Path, store: EmbeddedStore) -> None:
    cluster = Cluster(tmp_path / "run", store, _run("slowed", rounds=4), NODES)
    try:
        cluster.start_coordinator()
        for name in cluster.tokens:
            cluster.start_node(name)
        cluster.wait_closed(1)  # round 0 at full speed: round 1's deadline is learnt from it
        with Throttle(cluster.nodes.values(), factor=4):
            status = cluster.wait_finished()
        _assert_no_round_lost(cluster, status)
    finally:
        cluster.stop()
