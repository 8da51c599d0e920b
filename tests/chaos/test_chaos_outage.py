"""Outages the fleet must ride out by itself: a minute without the store, a minute without the
coordinator, and no node is touched.

Real processes (SeaweedFS, coordinator, nodes), the tiny model, 3 nodes, 7 rounds. Deadlines are
long (150-240 s) so a round can wait out the outage, as an operator would configure a run over
the internet. Faults, each keyed to a round:

- as round 2 opens, the object store stops for a minute (until a node logged that the store is
  unreachable and at least 60 s passed; 90 s at most): longer than a transfer's own retries, so
  uploads and downloads keep trying with fresh URLs while the round stays open;
- as round 5 opens, the coordinator is killed and started again on the same port 60 s later:
  every node waits for it, then goes on for two more rounds.

No node may exit or be restarted (the runner counts any unexpected exit as a failure), every
round must close with every node in its gather set, all invariants hold after every round, and
the final loss matches the same run without faults. That run goes on beside this one
(``Scenario.baseline_beside``): it fits in the two minutes this one spends waiting.
"""

from __future__ import annotations

from protocol.runconfig import RunConfig, Timing

from .scenario import Scenario, at
from .suite import chaos_test

TIMING = Timing(
    first_round_s=240,
    min_round_s=150,
    max_round_s=240,
    factor=2.0,
    margin_s=10.0,
    heartbeat_timeout_s=30,
)

RUN = RunConfig(
    name="chaos-outage",
    model="tiny",
    rounds=7,
    inner_steps=20,
    batch_size=4,
    min_nodes=3,
    checkpoint_every=4,
    retention_rounds=6,
    # An eval loss after every round: check (e) compares runs after equal outer steps.
    eval_every=1,
    timing=TIMING,
)

#: The least the store stays down: an outage as the field has them (a minute, not seconds), and
#: longer than the retries of one transfer (``node.daemon.transferopts.DEFAULT_POLICY``).
STORE_DOWN_S = 60

OUTAGE = Scenario(
    name="outage",
    run=RUN,
    nodes=3,
    steps=(
        at(2, "store_outage", min_s=STORE_DOWN_S, max_s=90),
        at(5, "coordinator_outage", min_s=60),
    ),
    timeout_s=600,
    baseline_beside=True,
)


def test_the_fleet_rides_out_store_and_coordinator_outages(tmp_path, store) -> None:
    result = chaos_test(OUTAGE, tmp_path, store)
    assert result["rounds_closed"] == RUN.rounds
    nodes = {f"node-{i}" for i in range(3)}
    for r in range(RUN.rounds):
        assert set(result["gather"][r]) == nodes, (r, result["excluded"].get(r))
    events = [e["action"] for e in result["events"]]
    assert "store_back" in events and "coordinator_back" in events
    store_back = next(e for e in result["events"] if e["action"] == "store_back")
    assert store_back["held_s"] >= STORE_DOWN_S and store_back["retry_seen"]
