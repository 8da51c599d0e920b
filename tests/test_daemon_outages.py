"""The daemon rides out outages: it waits, it resumes, and it stops when told, in any state.

The same in-process fakes as ``test_daemon.py``. An outage of the coordinator is modelled the
way the real client experiences it: every call waits until the coordinator answers again (the
client retries forever, with bounded backoff). An outage of the store makes every transfer give
up as the real one does after its own retries. Only a refusal that cannot heal (a revoked
token) ends the node, with a message that says what to do.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from node.compute.stateread import load_state
from node.errors import Refused
from support.daemon_harness import (
    HANG_S,
    PATIENT,
    reference_fingerprints,
    run_config,
    until,
    worker,
)

pytestmark = pytest.mark.asyncio


async def test_a_coordinator_outage_is_waited_out(harness) -> None:
    run = run_config()
    h = harness(run)
    task = h.start(h.daemon("node-0"))
    await until(lambda: bool(h.reports(0)), "round 0")
    h.coord.outage()
    await until(lambda: h.coord.waiting > 0, "node-0 to wait for the coordinator")
    await asyncio.sleep(0.3)
    assert not task.done()  # waiting, not exited
    h.coord.restore()
    assert await task == 0
    assert h.reports(run.rounds - 1)["node-0"].fingerprint == reference_fingerprints(run)[-1]


async def test_a_stop_is_honoured_within_the_grace_during_an_outage(harness) -> None:
    run = run_config()
    h = harness(run)
    daemon = h.daemon("node-0", stop_grace_s=0.2)
    task = h.start(daemon)
    await until(lambda: bool(h.reports(0)), "round 0")
    h.coord.outage()
    await until(lambda: h.coord.waiting > 0, "node-0 to wait for the coordinator")
    daemon.request_stop()
    assert await asyncio.wait_for(task, 10) == 0  # the leave cannot get through: it does not wait
    state = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert state is not None and state.phase in ("idle", "submitting")


async def test_a_store_outage_during_the_upload_is_ridden_out_within_the_round(
    harness, caplog
) -> None:
    caplog.set_level(logging.WARNING)
    run = run_config(rounds=2)
    h = harness(run)
    h.store.down = True
    task = h.start(h.daemon("node-0"))
    await h.advance_until(lambda: h.store.refused >= 4, step_s=2)  # the upload keeps trying
    assert not task.done() and h.store.puts == []
    h.store.down = False
    await h.advance_until(task.done, step_s=2)
    assert task.result() == 0
    assert [e.node_id for e in h.manifest(0).manifest.gather] == ["node-0"]  # not a missed round
    assert h.reports(1)["node-0"].fingerprint == reference_fingerprints(run)[-1]


async def test_a_revoked_token_ends_the_node_and_says_what_to_do(harness) -> None:
    h = harness(run_config(rounds=5))
    task = h.start(h.daemon("node-0"))
    await until(lambda: bool(h.reports(0)), "round 0")
    h.coord.revoked.add("node-0")
    with pytest.raises(Refused, match=r"revoked this node.s token.*ask the operator"):
        await task


async def test_a_join_refused_with_token_in_use_ends_the_node_at_once(harness) -> None:
    h = harness(run_config(rounds=1))
    h.coord.in_use["node-0"] = 1  # another live process holds node-0's token
    task = h.start(h.daemon("node-0"))
    # No fake time passes: a node that waited for the other process would never end.
    with pytest.raises(Refused, match="One token serves one node process") as info:
        await asyncio.wait_for(task, HANG_S)
    assert "token_in_use" in str(info.value) and "same --state-dir" in str(info.value)
    assert [endpoint for _, endpoint, _ in h.coord.calls] == ["join"]  # asked once


async def test_a_token_revoked_mid_training_ends_the_node_at_its_next_heartbeat(harness) -> None:
    steps = 100_000  # far more than the test lets it train
    # Beats every 2 s of fake time: PATIENT's window would make the loop below advance the
    # fake clock 2,500 s, half a second at a time, before the first heartbeat.
    timing = PATIENT.model_copy(update={"heartbeat_timeout_s": 8.0})
    run = run_config(rounds=2, inner_steps=steps, timing=timing)
    h = harness(run)
    daemon = h.daemon("node-0")
    task = h.start(daemon)

    def training() -> bool:
        return daemon.ctx.shard is not None and daemon.ctx.shard.worker.local_steps > 0

    await until(training, "node-0 to train")
    h.coord.revoked.add("node-0")
    before = len(h.coord.calls)
    interval = run.timing.heartbeat_timeout_s / 4
    waited = 0.0
    async with asyncio.timeout(HANG_S):
        while not task.done():
            h.coord.advance(0.5)
            waited += 0.5
            await asyncio.sleep(0.01)
    assert waited <= interval + 1.0  # fake time: within one heartbeat interval
    with pytest.raises(Refused, match="revoked this node's token") as info:
        await task
    assert "ask the operator for a new token" in str(info.value)
    # It learnt it from the heartbeat, abandoned the round in training (no submission), and
    # did not try to leave with a token that no longer works.
    assert {endpoint for _, endpoint, _ in h.coord.calls[before:]} == {"heartbeat"}
    assert daemon.ctx.shard is not None and daemon.ctx.shard.worker.local_steps < steps
    state = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert state is not None and state.phase == "idle" and state.round == 0


async def test_a_stop_before_the_join_names_no_unknown_node(harness, caplog) -> None:
    caplog.set_level(logging.INFO)
    h = harness(run_config(rounds=1))
    h.coord.outage()  # the join keeps waiting for the coordinator
    daemon = h.daemon("node-0")
    task = h.start(daemon)
    await until(lambda: h.coord.waiting > 0, "the join to wait")
    daemon.request_stop()
    assert await asyncio.wait_for(task, 10) == 0
    stops = [m for m in caplog.messages if "event=stop" in m]
    assert "event=stop_requested" in stops and any("before=joining" in m for m in stops)
    assert not any("node=?" in m for m in caplog.messages)


async def test_requests_are_heartbeats_and_only_a_silence_gets_one(harness) -> None:
    """Every request says the node's condition and counts as a heartbeat, so a node that keeps
    asking (here: for a round that waits for a second member) sends none; once it trains in
    silence it beats once per interval, which keeps a revocation within one interval."""
    timing = PATIENT.model_copy(update={"heartbeat_timeout_s": 8.0})  # beats every 2 s
    run = run_config(rounds=2, inner_steps=3_000, min_nodes=2, timing=timing)  # trains on
    h = harness(run)
    interval = run.timing.heartbeat_timeout_s / 4
    lonely = h.daemon("node-0")
    tasks = [h.start(lonely)]

    def beats() -> int:
        return sum(
            1 for node, endpoint, _ in h.coord.calls if (node, endpoint) == ("node-0", "heartbeat")
        )

    def asks() -> int:
        return sum(
            1 for node, endpoint, _ in h.coord.calls if (node, endpoint) == ("node-0", "round")
        )

    async def let_pass(seconds: float) -> None:
        for _ in range(round(seconds / 0.25)):
            h.coord.advance(0.25)
            await asyncio.sleep(0.01)

    try:
        await until(lambda: asks() > 0, "node-0 to ask for the round")
        before, asked = beats(), asks()
        await let_pass(4 * interval)
        assert asks() > asked + 4, "node-0 stopped asking"
        assert beats() == before  # it asked all along: heard, no heartbeat

        tasks.append(h.start(h.daemon("node-1")))
        await until(
            lambda: lonely.ctx.shard is not None and lonely.ctx.shard.worker.local_steps > 0,
            "node-0 to train",
        )
        before = beats()
        await let_pass(4 * interval)
        assert 3 <= beats() - before <= 5  # silent while it trains: one per interval
    finally:  # revoked, the nodes abandon their endless training between two steps
        for node in ("node-0", "node-1"):
            h.coord.revoked.add(node)
        waited = 0.0
        async with asyncio.timeout(HANG_S):
            while not all(task.done() for task in tasks):
                await let_pass(0.5)
                waited += 0.5
    assert waited <= interval + 1.0  # each learnt it within one interval of fake time
    for task in tasks:
        with pytest.raises(Refused):
            await task
