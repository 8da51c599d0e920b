"""No round is spent on nothing, with real processes: a store outage and a slowed fleet.

Real SeaweedFS, ``python -m coordinator`` and two ``python -m node`` processes (the tiny model),
with deadlines learnt as tight as the rules allow (the median of recent rounds plus 0.5 s).
Without holds, both faults below closed rounds with an empty gather set (checked on the code
before them: rounds 2 and 3 of the outage run closed empty, and the run finished during it):

- the store stops for 60 s as round 2 opens (its deadline is a few seconds; the nodes pause
  after training it, ``slow:10@2``, so the outage surely lands before anyone submitted): nodes
  cannot upload, the coordinator cannot check; the round must wait and gather once the store is
  back;
- every node trains 4x slower from round 5 on (``SPARSELOCO_FAULTS=slower:4@5``: after training
  it waits 3x the training's time), whose deadline was learnt from the fast rounds before. (A
  SIGSTOP/SIGCONT duty cycle slows a process 4x only on an idle machine: on a loaded one the
  scheduler gives a stopped process its share back, so the slowdown would depend on the load.)

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
from protocol.messages import RoundState
from protocol.runconfig import RunConfig, Timing
from protocol.status import StatusView
from support.cluster import Cluster

#: Deadlines as tight as the rules allow (the median of recent rounds plus half a second): any
#: round slower than the usual one runs past its deadline.
TIMING = Timing(
    first_round_s=120,
    min_round_s=1,
    max_round_s=300,
    factor=1.0,
    margin_s=0.5,
    heartbeat_timeout_s=20,
)
NODES = 2
OUTAGE_S = 60.0
#: How long each node pauses after training round 2 in the outage run (the store stops meanwhile).
STRAGGLE_S = 10.0


def _run(name: str, rounds: int, inner_steps: int = 10) -> RunConfig:
    return RunConfig(
        name=name,
        model="tiny",
        rounds=rounds,
        inner_steps=inner_steps,
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
        # Tiny rounds take a fraction of a second: each node pauses STRAGGLE_S after training
        # round 2 (before its upload), so the store surely stops while round 2 is open and
        # nobody has submitted to it, whatever the machine's speed.
        for name in cluster.tokens:
            cluster.start_node(name, faults=f"slow:{STRAGGLE_S:g}@2")
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
        assert "event=deadline_paused" in log and "event=deadline_resumed" in log
    finally:
        cluster.stop()


def test_a_slowed_fleet_loses_no_round(tmp_path: Path, store: EmbeddedStore) -> None:
    run = _run("slowed", rounds=7, inner_steps=30)
    cluster = Cluster(tmp_path / "run", store, run, NODES)
    try:
        cluster.start_coordinator()
        # Rounds 0-4 at full speed (0 and 1 also pay the start-up; the median of five ignores
        # them): round 5's deadline is learnt from them, then every node trains 4x slower.
        for name in cluster.tokens:
            cluster.start_node(name, faults="slower:4@5")
        status = cluster.wait_finished()
        _assert_no_round_lost(cluster, status)
    finally:
        cluster.stop()
