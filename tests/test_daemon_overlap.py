"""Overlap in the daemon (``node.daemon.overlap``): round r+1 trains while round r's payloads
travel, against the in-memory fakes and the real round machine.

What must hold is what holds without overlap: every node ends each round on the same θ (the
one-node reference computes it straight through the worker), every payload is gathered (its
base is θ_{r-1}, which the coordinator checks), a crash loses nothing, and the error-feedback
account balances.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from node.compute.stateread import load_state
from node.daemon.faults import Faults
from protocol.messages import Exclusion, MemberState, RoundState, RoundView
from support.daemon_harness import (
    Crash,
    assert_mass_balanced,
    crash_at,
    reference_fingerprints,
    run_config,
    until,
    worker,
)
from support.diverge import diverge, once

pytestmark = pytest.mark.asyncio


def _schedule(variant: str, **changes: object) -> dict[str, object]:
    """A variant's run settings: "merge-rows" merges inside step τ, after one row of two;
    "merge-step" after the whole first step; "merge" alone at the default point (inside the
    first step, ``DEFAULT_MERGE_SHARE`` of its rows in)."""
    if variant == "merge-rows":
        return {"overlap": "merge", "overlap_rows": 1, **changes}
    if variant == "merge-step":
        return {"overlap": "merge", "overlap_tau": 1, **changes}
    return {"overlap": variant, **changes}


@pytest.mark.parametrize("variant", ["delayed", "eager", "merge", "merge-step"])
async def test_one_node_runs_the_whole_run_bit_for_bit(harness, variant: str) -> None:
    run = run_config(**_schedule(variant, rounds=4))
    h = harness(run)
    assert await h.daemon("node-0").run(handle_signals=False) == 0
    expected = reference_fingerprints(run)
    if variant != "eager":  # (eager, alone, guesses the aggregate exactly: its own update)
        assert expected != reference_fingerprints(run_config(rounds=4))
    if variant == "merge":  # by default inside the first step, which is not after it
        assert run.merge_rows == 1
        assert expected != reference_fingerprints(run_config(**_schedule("merge-step", rounds=4)))
    for r in range(run.rounds):
        report = h.reports(r)["node-0"]
        assert report.fingerprint == expected[r]
        assert [e.node_id for e in h.manifest(r).manifest.gather] == ["node-0"]
        assert {"train", "encode", "upload", "download", "decode", "save"} <= set(report.timings)
        assert_mass_balanced(report.mass)
    state = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert state is not None and state.round == run.rounds and state.phase == "idle"
    assert state.fingerprint == expected[-1]


async def test_payloads_are_trained_from_the_theta_before_the_aggregate_in_flight(
    harness,
) -> None:
    run = run_config(overlap="eager", rounds=4)
    h = harness(run)
    first, second = h.start(h.daemon("node-0")), h.start(h.daemon("node-1"))
    assert await first == 0 and await second == 0
    for r in range(run.rounds):
        signed = h.manifest(r).manifest
        reports = h.reports(r)
        assert {e.node_id for e in signed.gather} == {"node-0", "node-1"}, signed.excluded
        assert reports["node-0"].fingerprint == reports["node-1"].fingerprint
        if r >= 2:  # round r's base: θ_{r-1}, the fingerprint reported after round r-2
            assert signed.base_fingerprint == h.reports(r - 2)["node-0"].fingerprint


async def test_merged_payloads_are_trained_from_the_theta_after_the_aggregate_in_flight(
    harness,
) -> None:
    # "merge" applies round r-1's aggregate at step τ of round r: round r's base is θ_r, the
    # fingerprint reported after round r-1, as without overlap (``RunConfig.base_round``).
    run = run_config(overlap="merge", rounds=4, inner_steps=3, overlap_tau=2)
    h = harness(run)
    first, second = h.start(h.daemon("node-0")), h.start(h.daemon("node-1"))
    assert await first == 0 and await second == 0
    for r in range(run.rounds):
        signed = h.manifest(r).manifest
        reports = h.reports(r)
        assert {e.node_id for e in signed.gather} == {"node-0", "node-1"}, signed.excluded
        assert reports["node-0"].fingerprint == reports["node-1"].fingerprint
        for report in reports.values():
            assert_mass_balanced(report.mass)
            # Rounds trained beside a transfer stood at step τ: that wait is its own phase,
            # not training (bench overlap's utilisation counts training only).
            if r >= 1:
                assert report.timings["merge_wait"] >= 0.0 and report.timings["train"] >= 0.0
        if r >= 1:
            assert signed.base_fingerprint == h.reports(r - 1)["node-0"].fingerprint


@pytest.mark.parametrize("variant", ["delayed", "merge", "merge-rows"])
@pytest.mark.parametrize(
    "point", ["after_train", "mid_upload", "after_upload", "after_submit", "mid_apply"]
)
async def test_a_crash_anywhere_in_an_overlapped_round_loses_nothing(
    harness, point: str, variant: str
) -> None:
    # "delayed" and "merge" keep nothing beside the saved state (the merge writes nothing: a
    # crash before "submitting r+1" is committed merges again at the same step), so the run
    # is the uninterrupted one.
    tau = {} if variant == "delayed" else {"overlap_tau": 2}
    run = run_config(**_schedule(variant, rounds=4, inner_steps=3, **tau))
    h = harness(run)
    with pytest.raises(Crash):
        await h.daemon("node-0", faults=crash_at(2, point)).run(handle_signals=False)
    assert await h.daemon("node-0").run(handle_signals=False) == 0
    expected = reference_fingerprints(run)
    assert [h.reports(r)["node-0"].fingerprint for r in range(run.rounds)] == expected


@pytest.mark.parametrize("point", ["after_train", "mid_upload", "mid_apply"])
async def test_an_eager_node_restarts_with_one_delayed_round(harness, point: str) -> None:
    # Eager's estimate of the aggregate in flight uses the last aggregate's step, which lives
    # in memory only: after a restart one round trains from θ itself, as delayed does. Only
    # this node's own training differs; what it sends and applies stays whole.
    run = run_config(overlap="eager", rounds=4)
    h = harness(run)
    with pytest.raises(Crash):
        await h.daemon("node-0", faults=crash_at(2, point)).run(handle_signals=False)
    assert await h.daemon("node-0").run(handle_signals=False) == 0
    for r in range(run.rounds):
        assert [e.node_id for e in h.manifest(r).manifest.gather] == ["node-0"]
        assert_mass_balanced(h.reports(r)["node-0"].mass)
    state = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert state is not None and state.phase == "idle"
    assert state.fingerprint == h.reports(run.rounds - 1)["node-0"].fingerprint


@pytest.mark.parametrize("variant", ["eager", "merge"])
async def test_a_round_missed_while_training_the_next_keeps_the_contribution(
    harness, variant: str
) -> None:
    run = run_config(overlap=variant, rounds=3)
    h = harness(run)
    # Round 1's payload waits 5 s before its upload (beside round 2's training).
    task = h.start(h.daemon("node-0", Faults(slow={1: 5.0})))
    await until(lambda: 5.0 in h.clock.sleeping, "node-0 to straggle")
    # node-0 is alone: a round nobody submitted to is held while a member says it trains
    # (test_coordinator_holds.py). Here it is heard as a node that does not say what it does
    # (an older one), so the deadline closes the round without it, as it always did.
    h.coord.machine.heartbeat("node-0", None)
    h.coord.advance(1001)  # round 1's deadline passes; it closes without node-0
    assert await task == 0
    closed = h.manifest(1).manifest
    assert closed.gather == [] and closed.excluded == {"node-0": Exclusion.MISSED_DEADLINE}
    missed = h.reports(1)["node-0"].mass
    assert missed is not None and missed.sent == 0.0 and missed.computed != 0.0
    assert_mass_balanced(missed)  # everything computed is held: ĉ went back into e
    for r in (0, 2):
        mass = h.reports(r)["node-0"].mass
        assert mass is not None and mass.sent != 0.0
        assert_mass_balanced(mass)
    assert [e.node_id for e in h.manifest(2).manifest.gather] == ["node-0"]


@pytest.mark.parametrize("variant", ["eager", "merge"])
async def test_a_diverged_node_resyncs_and_ends_bit_identical(
    harness, caplog, variant: str
) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.node")
    h = harness(run_config(overlap=variant, rounds=5, min_nodes=3))
    nodes = ["node-0", "node-1", "node-2"]
    tasks = [
        h.start(diverge(h.daemon(n), once({0})) if n == "node-2" else h.daemon(n)) for n in nodes
    ]
    for task in tasks:
        assert await task == 0
    # θ_1 of node-2 is wrong: its round-2 payload (trained from θ_1) is refused, and it sees
    # the divergence when round 2's manifest names θ_1's majority fingerprint. (merge: the
    # fault lands once round 1, which merged θ_1 at step τ, finished training, so its payload
    # is whole; the node sees the divergence at step τ of round 2, against round 1's base.)
    if variant == "eager":
        assert h.manifest(2).manifest.excluded.get("node-2") == Exclusion.WRONG_BASE
    else:
        assert any("event=merge_abandoned node=node-2" in m for m in caplog.messages)
    assert any("event=resynced node=node-2" in m for m in caplog.messages)
    last = h.reports(h.run.rounds - 1)
    assert set(last) == set(nodes) and len({r.fingerprint for r in last.values()}) == 1


@pytest.mark.parametrize("variant", ["eager", "merge"])
async def test_sigterm_while_the_next_round_trains_leaves_and_resumes(
    harness, variant: str
) -> None:
    # (merge: τ = 5, so the stop lands after the merge: θ_1 in memory is dropped unsaved)
    tau = {"overlap_tau": 5} if variant == "merge" else {}
    run = run_config(overlap=variant, rounds=3, inner_steps=400, **tau)
    h = harness(run)
    daemon = h.daemon("node-0")
    task = asyncio.create_task(daemon.run(handle_signals=True))
    # Round 0 trained and committed; round 1 trains beside round 0's transfers.
    await until(
        lambda: daemon.ctx.shard is not None and daemon.worker.local_steps > 410, "round 1 training"
    )
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 60) == 0
    assert h.coord.db.member("node-0").state == MemberState.LEFT
    state = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert state is not None and (state.round, state.phase) == (0, "submitting")
    # Started again, it finishes the run. The rounds open while it was away closed without
    # it (it left); its round-0 payload was either in round 0 or went back into e.
    assert await h.daemon("node-0").run(handle_signals=False) == 0
    for r in range(run.rounds):
        m = h.manifest(r).manifest
        assert [e.node_id for e in m.gather] == ["node-0"] or m.excluded == {"node-0": "left"}
        if m.gather:
            assert_mass_balanced(h.reports(r)["node-0"].mass)
    assert [e.node_id for e in h.manifest(run.rounds - 1).manifest.gather] == ["node-0"]
    final = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert final is not None and (final.round, final.phase) == (run.rounds, "idle")


async def test_a_node_that_first_sees_round_zero_waiting_trains_it_before_overlapping(
    harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by ``bench wan`` (docs/benchmarks.md §17): the first node to join saw round 0 still
    # waiting for members, took that for "not expected" and trained round 1 beside round 0
    # without ever submitting round 0, which then waited for its deadline.
    h = harness(run_config(overlap="eager", min_nodes=2, rounds=3))
    early = h.daemon("node-0")
    seen: list[str] = []
    ask = early.api.round

    async def round_view() -> RoundView:
        view = await ask()
        seen.append(view.state)
        return view

    monkeypatch.setattr(early.api, "round", round_view)
    first = h.start(early)
    await until(lambda: bool(seen), "node-0's first round view")
    assert seen[0] == RoundState.WAITING
    second = h.start(h.daemon("node-1"))
    async with asyncio.timeout(60):
        assert await first == 0 and await second == 0
    for r in range(h.run.rounds):
        assert {e.node_id for e in h.manifest(r).manifest.gather} == {"node-0", "node-1"}
