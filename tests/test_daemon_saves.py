"""What a node writes to its state directory, and when it measures the held-out loss.

A round the node trained is saved once, after training (``submitting``); applying its aggregate
is not saved, because a restart finishes the round again from that state and the round's
manifest. These tests kill the node (``Crash``, which leaves the state dir as kill -9 does) at
points where only that one save exists, and check that it ends bit-identical to the reference
with every error-feedback account balanced. Evaluation follows the run's schedule
(``RunConfig.eval_every``) unless the node's own ``eval_every`` setting says otherwise.
"""

from __future__ import annotations

import pytest

from node.compute.stateread import load_state
from support.daemon_harness import Crash, crash_at, run_config, worker
from test_daemon import assert_mass_balanced

pytestmark = pytest.mark.asyncio


async def test_an_applied_round_is_not_saved_and_a_restart_finishes_it_again(harness) -> None:
    run = run_config(rounds=4)
    h = harness(run)
    with pytest.raises(Crash):  # killed after training round 2, before anything of it is saved
        await h.daemon("node-0", crash_at(2, "after_train")).run(handle_signals=False)
    state_dir = h.state_dir("node-0")
    state = load_state(state_dir, worker(run).shapes)
    # Round 1 was applied and reported, yet the state on disk is still the one its training
    # wrote, next to its payload: nothing else was written after it.
    assert state is not None and state.round == 1 and state.phase == "submitting"
    assert sorted(p.name for p in state_dir.glob("pending*")) == ["pending-1.slc"]

    assert await h.daemon("node-0").run(handle_signals=False) == 0
    # The same run without the kill, by a daemon too: torch's results may depend on the
    # thread a computation runs in, and the daemon's compute thread is the one to compare with.
    straight = harness(run)
    assert await straight.daemon("node-0").run(handle_signals=False) == 0
    expected = [straight.reports(r)["node-0"].fingerprint for r in range(run.rounds)]
    for r in range(run.rounds):
        report = h.reports(r)["node-0"]
        assert report.fingerprint == expected[r]
        assert_mass_balanced(report.mass)
    final = load_state(state_dir, worker(run).shapes)  # the run's end is saved as it is
    assert final is not None and final.round == run.rounds and final.phase == "idle"
    assert list(state_dir.glob("pending*")) == []


async def test_two_nodes_one_killed_mid_round_end_bit_identical(harness) -> None:
    run = run_config(rounds=4, min_nodes=2)
    h = harness(run)
    steady = h.start(h.daemon("node-1"))
    with pytest.raises(Crash):  # round 2 trained and saved, round 1's apply never written
        await h.daemon("node-0", crash_at(2, "after_upload")).run(handle_signals=False)
    assert await h.daemon("node-0").run(handle_signals=False) == 0
    assert await steady == 0
    for r in range(run.rounds):
        reports = h.reports(r)
        assert set(reports) == {"node-0", "node-1"}
        assert len({rep.fingerprint for rep in reports.values()}) == 1


async def test_the_held_out_loss_follows_the_runs_schedule(harness) -> None:
    run = run_config(rounds=7, eval_every=3)
    h = harness(run)
    assert await h.daemon("node-0").run(handle_signals=False) == 0
    evaluated = [r for r in range(run.rounds) if h.reports(r)["node-0"].eval_loss is not None]
    assert evaluated == [0, 2, 5, 6]  # the first, every third, the last
    assert "eval" not in h.reports(1)["node-0"].timings
    assert "eval" in h.reports(2)["node-0"].timings


async def test_the_nodes_own_eval_every_setting_overrides_the_schedule(harness) -> None:
    run = run_config(rounds=3, eval_every=10)
    h = harness(run)
    assert await h.daemon("node-0", eval_every=1).run(handle_signals=False) == 0
    assert all(h.reports(r)["node-0"].eval_loss is not None for r in range(run.rounds))
