"""The long chaos scenario (run by hand; its table goes in the README): every fault kind.

5 nodes, 48 rounds, the tiny model, checkpoints every 5 rounds and payloads kept 8 rounds, so a
node joining at round 14 cannot replay from θ_0 and must start from a checkpoint. Faults, each
keyed to a round:

- round 3: node-1 killed (``kill -9``), restarted once round 3 closed;
- round 5: node-2 crashes mid-apply (aggregate applied in memory, state not saved);
- round 7: node-3 crashes after its upload, before submitting;
- round 9: coordinator killed and restarted on the same port;
- round 11: the object store stopped until a node logged a retry (at least 5 s, at most 20 s);
- round 14: node-4 joins, 14 rounds late;
- round 17: node-0's θ silently corrupted: reported, excluded as wrong base in round 18,
  resynchronised from the checkpoint, gathered again later;
- round 20: node-2 stopped (SIGSTOP) until the coordinator times it out, then continued;
- round 24: node-0 straggles 15 s (deadlines are 8-12 s);
- round 26: node-1 killed again, restarted once round 27 closed (two rounds down), with 20
  rounds to spare after it so it is seen back in a gather set: rounds here take about a
  second once the faults are over and a restart 5-9 s plus its catch-up, which 8 spare
  rounds (36 in all) did not always cover.

Network faults (delay, jitter, resets on capped links) are the WAN lab's run,
``tests/test_wan_run.py``, in the default suite.

Marked ``slow``: pyproject's ``addopts`` deselects it from the default run (CI); select it
with ``-m slow``.
"""

from __future__ import annotations

import pytest

from protocol.runconfig import RunConfig, Timing

from .scenario import Scenario, at
from .suite import chaos_test

pytestmark = pytest.mark.slow

TIMING = Timing(
    first_round_s=60,
    min_round_s=8,
    max_round_s=12,
    factor=2.0,
    margin_s=2.0,
    heartbeat_timeout_s=15,
)

RUN = RunConfig(
    name="chaos-long",
    model="tiny",
    rounds=48,
    inner_steps=20,
    batch_size=4,
    min_nodes=3,
    checkpoint_every=5,
    retention_rounds=8,
    # An eval loss after every round: check (e) compares runs after equal outer steps.
    eval_every=1,
    timing=TIMING,
)

LONG = Scenario(
    name="long",
    run=RUN,
    nodes=5,
    faults={
        "node-0": "corrupt@17,slow:15@24",
        "node-2": "crash:mid_apply@5",
        "node-3": "crash:after_upload@7",
    },
    steps=(
        at(3, "kill_node", "node-1"),
        at(3, "restart_node", "node-1", when="closed"),
        at(9, "kill_coordinator"),
        at(9, "restart_coordinator"),
        at(11, "store_outage", min_s=5, max_s=20),
        at(14, "start_node", "node-4"),
        at(20, "pause_node", "node-2", max_s=60),
        at(26, "kill_node", "node-1"),
        at(27, "restart_node", "node-1", when="closed"),
    ),
    # Counted from the round each node is back in the run (``results``), so the seconds a
    # restarted process needs (Python, torch, compiled codec) no longer count. One more than
    # the default: node-1, back after its second kill, finds its pending round pruned and
    # skips to a checkpoint (download, then replay). Not yet measured with this count (the
    # README's table counts from the fault's round).
    recover_within=4,
    timeout_s=1200,
)


def _log(result_dir, node: str) -> str:
    return (result_dir / "long" / "logs" / f"{node}.log").read_text(errors="replace")


def test_long_chaos_scenario(tmp_path, store) -> None:
    result = chaos_test(LONG, tmp_path, store)
    assert result["rounds_closed"] == RUN.rounds
    # The late joiner started from a checkpoint: the payloads before it were already pruned.
    assert "event=checkpoint_loaded" in _log(tmp_path, "node-4")
    assert min(r for r, g in result["gather"].items() if "node-4" in g) >= 14
    # The corrupted node was excluded as diverged, resynchronised, and agrees again.
    assert result["excluded"].get(18, {}).get("node-0") == "wrong base fingerprint"
    assert "event=resynced" in _log(tmp_path, "node-0")
    # The stopped node was timed out; the store outage was noticed by a node's retries.
    reasons = {why for ex in result["excluded"].values() for why in ex.values()}
    assert "timed out" in reasons
    assert any(e["action"] == "store_back" and e["retry_seen"] for e in result["events"])
    # Every node that suffered a fault took part again before the end.
    for rec in result["recovery"]:
        assert rec["back_in_gather"] is not None, rec
