"""Unequal participants with real processes: one node of four slows to a third from round 4.

Real SeaweedFS, ``python -m coordinator`` and four ``python -m node`` processes (the ``small``
model), the run's default time budget (``[run.timing] budget = "median"``). From round 4 node-3
trains every inner step three times as slowly (``SPARSELOCO_FAULTS=slowsteps:3@4``: after each
step it sleeps twice that step's time, a slower GPU; a SIGSTOP/SIGCONT duty cycle would depend on
the machine's load, ``test_no_lost_rounds``).

Verdicts are behaviour, never times: every round closes and gathers; the slowed node is in at
least 90 % of the gather sets; once the budget has learnt the others' pace its rounds are cut
(fewer than H steps, "compute" in its report, the steps in the signed manifest and in the status),
the others train whole rounds, every node that reported a round reported the same
fingerprint, and no node rejected a peer (a clean run of unequal work screens nobody). The
wall-time shares these give are benchmark 19's (``sparseloco bench straggler``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from node.cluster.seaweed import EmbeddedStore
from protocol.messages import RoundState
from protocol.runconfig import RunConfig, Timing
from support.cluster import Cluster

H = 40
ROUNDS = 10
SLOW_FROM = 4
SLOW = "node-3"


def test_a_node_slowed_to_a_third_is_cut_short_and_stays_in_the_run(
    tmp_path: Path, store: EmbeddedStore
) -> None:
    run = RunConfig(
        name="unequal",
        model="small",
        rounds=ROUNDS,
        inner_steps=H,
        batch_size=8,
        min_nodes=4,
        checkpoint_every=0,
        eval_every=100,
        timing=Timing(first_round_s=240, heartbeat_timeout_s=60),
    )
    cluster = Cluster(tmp_path / "run", store, run, 4)
    try:
        cluster.start_coordinator()
        for name in cluster.tokens:
            cluster.start_node(name, faults=f"slowsteps:3@{SLOW_FROM}" if name == SLOW else None)
        status = cluster.wait_finished()
    finally:
        cluster.stop()
    closed = sorted(
        (r for r in status.rounds if r.state == RoundState.CLOSED), key=lambda r: r.round
    )
    assert [r.round for r in closed] == list(range(ROUNDS))
    for r in closed:
        assert r.gather, f"round {r.round} closed empty: {r.excluded}"
        assert len(set(r.fingerprints.values())) == 1, (r.round, r.fingerprints)
        # A clean run of unequal work screens nobody: less work is no reason to be rejected.
        for node, report in r.reports.items():
            assert not report.rejected, (r.round, node, report.rejected)
    with_slow = [r.round for r in closed if SLOW in r.gather]
    assert len(with_slow) >= 0.9 * ROUNDS, (with_slow, {r.round: r.excluded for r in closed})
    # The budget learns the others' pace from the rounds after the slowdown began (round 4 itself
    # has the budget of equal rounds, so the slowed node may fit in it or run a little over).
    later = [r for r in closed if SLOW_FROM + 1 <= r.round < ROUNDS]
    slow_steps = [r.work[SLOW].steps for r in later if SLOW in r.work]
    assert slow_steps and all(s is not None and s < H for s in slow_steps), slow_steps
    cuts = [r.reports[SLOW].cut for r in later if SLOW in r.reports]
    assert cuts.count("compute") >= len(cuts) - 1, cuts
    for node in ("node-0", "node-1", "node-2"):
        steps = [r.work[node].steps for r in later if node in r.work]
        assert statistics.median(s or 0 for s in steps) == H, (node, steps)
    # Its share of the work is what it brought: less than a quarter, more than nothing.
    shares = [r.work[SLOW].share for r in later if SLOW in r.work]
    assert all(0 < s < 0.25 for s in shares), shares
