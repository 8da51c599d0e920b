"""The node daemon's round loop, branch by branch, against the in-memory fakes.

The real ``NodeDaemon`` (training, codec, aggregation, state files and all) runs in this process
against the real round machine (``support.fake_coordinator``) and an in-memory store and clock:
no process, no socket, no sleep on the wall clock. Each test checks what can be observed from
the outside: the coordinator's manifests and reports, the store's objects, the state directory.
The multi-process tests (``test_network_run.py``, ``tests/chaos``) cover the same ground with real
processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest

from node.compute.stateread import load_state
from node.daemon.faults import Faults
from protocol.keys import payload_key
from protocol.messages import Exclusion, MemberState
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


async def test_one_node_runs_the_whole_run_bit_for_bit(harness) -> None:
    run = run_config()
    h = harness(run)
    assert await h.daemon("node-0").run(handle_signals=False) == 0
    expected = reference_fingerprints(run)
    for r in range(run.rounds):
        report = h.reports(r)["node-0"]
        assert report.fingerprint == expected[r]
        assert [e.node_id for e in h.manifest(r).manifest.gather] == ["node-0"]
        # Its own payload too is read back from the store: what its peers aggregate.
        assert report.bytes_up > 0 and report.bytes_down == report.bytes_up
        assert {"train", "encode", "upload", "download", "decode", "save"} <= set(report.timings)
        assert_mass_balanced(report.mass)
    state = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert state is not None and state.round == run.rounds and state.phase == "idle"
    assert state.fingerprint == expected[-1]


async def test_a_waiting_round_opens_when_enough_nodes_joined_and_both_agree(harness) -> None:
    h = harness(run_config(min_nodes=2))
    first = h.start(h.daemon("node-0"))
    await until(lambda: ("node-0", "join") in [c[:2] for c in h.coord.calls], "node-0 to join")
    assert h.coord.machine.round_view("node-0").state == "waiting"
    second = h.start(h.daemon("node-1"))
    assert await first == 0 and await second == 0
    for r in range(h.run.rounds):
        reports = h.reports(r)
        gathered = {e.node_id for e in h.manifest(r).manifest.gather}
        assert gathered == set(reports) == {"node-0", "node-1"}
        assert reports["node-0"].fingerprint == reports["node-1"].fingerprint


async def test_a_restart_resends_the_pending_payload_byte_for_byte(harness) -> None:
    run = run_config()
    h = harness(run)
    with pytest.raises(Crash):  # kill -9 after the PUT of round 1, before its submit
        await h.daemon("node-0", crash_at(1, "after_upload")).run(handle_signals=False)
    state = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert state is not None and state.round == 1 and state.phase == "submitting"
    key = payload_key("", run.run_id, 1, "node-0")
    uploaded = h.store.objects[key]
    assert (h.state_dir("node-0") / "pending-1.slc").read_bytes() == uploaded

    assert await h.daemon("node-0").run(handle_signals=False) == 0
    sent = [data for _, k, data in h.store.puts if k == key]
    assert sent == [uploaded, uploaded]  # the same bytes again, not a retrained round
    assert [e.node_id for e in h.manifest(1).manifest.gather] == ["node-0"]
    assert h.reports(run.rounds - 1)["node-0"].fingerprint == reference_fingerprints(run)[-1]


async def test_a_missed_round_keeps_the_contribution_in_the_error_buffer(harness) -> None:
    run = run_config(rounds=2)
    h = harness(run)
    # A straggler: after training round 0 it holds for 5 s before uploading.
    task = h.start(h.daemon("node-0", Faults(slow={0: 5.0})))
    await until(lambda: 5.0 in h.clock.sleeping, "node-0 to straggle")
    # node-0 is alone: a round nobody submitted to is held while a member says it trains
    # (test_coordinator_holds.py). Here it is heard as a node that does not say what it does
    # (an older one), so the deadline closes the round without it, as it always did.
    h.coord.machine.heartbeat("node-0", None)
    h.coord.advance(1001)  # round 0's deadline passes; it closes without node-0
    assert await task == 0
    closed = h.manifest(0).manifest
    assert closed.gather == [] and closed.excluded == {"node-0": Exclusion.MISSED_DEADLINE}
    assert not any(k == payload_key("", run.run_id, 0, "node-0") for _, k, _ in h.store.puts)
    mass = h.reports(0)["node-0"].mass
    assert mass is not None and mass.sent == 0.0 and mass.computed != 0.0
    assert_mass_balanced(mass)  # everything computed is held: ĉ went back into e
    nxt = h.reports(1)["node-0"].mass
    assert nxt is not None and nxt.sent != 0.0
    assert_mass_balanced(nxt)


async def test_a_wrong_base_fingerprint_resyncs_and_ends_bit_identical(harness, caplog) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.node")
    h = harness(run_config(min_nodes=3))
    nodes = ["node-0", "node-1", "node-2"]
    tasks = [
        h.start(diverge(h.daemon(n), once({0})) if n == "node-2" else h.daemon(n)) for n in nodes
    ]
    for task in tasks:
        assert await task == 0
    second = h.manifest(1).manifest
    assert second.excluded.get("node-2") == Exclusion.WRONG_BASE
    assert "node-2" not in {e.node_id for e in second.gather}
    assert any("event=resynced node=node-2" in m for m in caplog.messages)
    last = h.reports(h.run.rounds - 1)
    assert set(last) == set(nodes) and len({r.fingerprint for r in last.values()}) == 1
    # After the resync it replayed rounds 0 and 1 from θ_0 and reported them like its peers.
    assert len({r.fingerprint for r in h.reports(1).values()}) == 1
    assert h.reports(0)["node-2"].fingerprint != h.reports(0)["node-0"].fingerprint  # corrupted


async def test_sigterm_between_inner_steps_abandons_the_round_and_leaves(harness) -> None:
    run = run_config(inner_steps=400)
    h = harness(run)
    daemon = h.daemon("node-0")
    task = asyncio.create_task(daemon.run(handle_signals=True))
    await until(lambda: daemon.ctx.shard is not None and daemon.worker.local_steps > 0, "training")
    os.kill(os.getpid(), signal.SIGTERM)
    assert await asyncio.wait_for(task, 60) == 0
    assert h.store.puts == []
    assert h.coord.db.member("node-0").state == MemberState.LEFT
    state = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert state is not None and state.round == 0 and state.phase == "idle"
    assert state.fingerprint == worker(run).fingerprint()  # θ_0, untouched by the abandoned steps
    assert all(bool((e == 0).all()) for e in state.error.values())


@pytest.mark.asyncio
async def test_a_replayed_rounds_refused_report_says_nothing_but_others_do() -> None:
    """A node catching up reports rounds it took no part in; the coordinator answers
    ``not_member`` (13 INFO lines in one catch-up, before): now silent. Other refusals still
    make a line."""
    from types import SimpleNamespace

    from node.daemon.rounds import RoundFinisher
    from node.errors import CoordinatorError
    from protocol.reports import RoundReport

    logged: list[tuple[str, dict[str, object]]] = []
    refusal = {"error": "not_member"}

    async def refuse(round_: int, report: RoundReport) -> None:
        raise CoordinatorError(409, str(refusal["error"]), "no part in that round")

    daemon = SimpleNamespace(
        api=SimpleNamespace(report=refuse), log=lambda event, **f: logged.append((event, f))
    )
    finisher = RoundFinisher(daemon)
    report = RoundReport(fingerprint="a" * 32)
    await finisher.report(3, report)
    assert logged == []
    refusal["error"] = "round_open"
    await finisher.report(4, report)
    assert logged == [("report_refused", {"error": "round_open"})]
