"""The daemon when downloads fail: refetch with fresh URLs, stop loudly, skip a pruned round.

Same fakes as ``test_daemon.py`` (the real daemon against the real round machine, an in-memory
store and clock). A node must never apply an aggregate its peers did not: a gather set it cannot
fetch completely is fetched again with fresh URLs, and if that keeps failing the node stops with
its state untouched. A round whose payloads retention already deleted (404) is not replayable,
so the node continues from a newer checkpoint. The fake's file transfers (``put_file``,
``get_to_file``) keep the ``Transfers`` contract the real ones keep (``test_transfer.py``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

import pytest

from node.compute.stateread import load_state
from node.daemon.api import Transfers
from node.daemon.gather import fetch_gather
from node.daemon.transfer import HttpTransfers
from node.errors import DigestError, RetriesExhausted, TransferError
from protocol.keys import payload_key, round_prefix
from protocol.messages import Manifest, ManifestEntry, ManifestView, MemberState, SignedManifest
from protocol.runconfig import Timing
from support.daemon_harness import Crash, crash_at, run_config, worker
from support.fake_store import FakeStore, NodeTransfers

pytestmark = pytest.mark.asyncio


async def test_a_failed_fetch_is_fetched_again_and_the_nodes_agree(harness, caplog) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.node")
    h = harness(run_config(min_nodes=2))
    h.store.transfers("node-0").plan.failing = 1  # node-0's first GET gives up
    tasks = [h.start(h.daemon(n)) for n in ("node-0", "node-1")]
    assert [await t for t in tasks] == [0, 0]
    waited = [m for m in caplog.messages if "event=download_waiting node=node-0" in m]
    assert len(waited) == 1 and "applied_round=0" in waited[0]
    assert any("event=download_resumed node=node-0" in m for m in caplog.messages)
    for r in range(h.run.rounds):
        reports = h.reports(r)
        assert reports["node-0"].fingerprint == reports["node-1"].fingerprint
        assert reports["node-0"].rejected == {}


async def test_a_fetch_that_keeps_failing_waits_and_never_applies_a_part(harness, caplog) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.node")
    run = run_config(min_nodes=2)
    h = harness(run)
    plan = h.store.transfers("node-0").plan
    plan.failing = 10**6  # node-0 cannot reach the store: the others can
    tasks = [h.start(h.daemon(n)) for n in ("node-0", "node-1")]
    await h.advance_until(lambda: plan.calls >= 6, step_s=5)  # many attempts, fresh URLs each
    assert not tasks[0].done()  # still waiting, not exited
    waited = [m for m in caplog.messages if "event=download_waiting node=node-0" in m]
    assert len(waited) == 1  # logged once, not once per attempt
    state = load_state(h.state_dir("node-0"), worker(run).shapes)
    assert state is not None and state.round == 0 and state.phase == "submitting"
    assert "node-0" not in h.reports(0)  # it applied nothing, so it reported nothing

    plan.failing = 0  # the store answers again: node-0 catches up by itself
    await h.advance_until(lambda: all(t.done() for t in tasks), step_s=5)
    assert [t.result() for t in tasks] == [0, 0]
    last = h.reports(run.rounds - 1)
    assert last["node-0"].fingerprint == last["node-1"].fingerprint


async def test_a_pruned_round_skips_ahead_to_the_newest_checkpoint(harness, caplog) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.node")
    timing = Timing(first_round_s=200, min_round_s=200, max_round_s=200, heartbeat_timeout_s=100)
    run = run_config(rounds=6, min_nodes=1, checkpoint_every=2, retention_rounds=3, timing=timing)
    h = harness(run)
    for node in ("node-0", "node-1"):  # both members from the start: both expected in round 0
        await h.coord.api(node).join()
    with pytest.raises(Crash):  # node-1 applies round 0, then dies while training round 1
        await asyncio.gather(
            h.daemon("node-1", crash_at(1, "after_train")).run(handle_signals=False),
            survivor := h.start(h.daemon("node-0")),
        )
    # Round 1 waits for node-1 until it times out; then node-0 goes on alone.
    await h.advance_until(lambda: h.coord.machine.round_number() >= 2, step_s=20)
    assert await survivor == 0
    assert h.coord.db.member("node-1").state == MemberState.TIMED_OUT
    newest = h.coord.book.latest()
    assert newest is not None and newest.round == run.rounds  # θ at the end of the run
    for r in range(4):  # what retention would have deleted by round 4
        h.store.delete_prefix(round_prefix("", run.run_id, r) + "payloads/")

    assert await h.daemon("node-1").run(handle_signals=False) == 0
    assert any("event=skipped_to_checkpoint node=node-1" in m for m in caplog.messages)
    theta = worker(run).shapes
    assert h.saved_fingerprint("node-1", theta) == h.saved_fingerprint("node-0", theta)


async def test_one_failed_download_cancels_the_others_at_once() -> None:
    store = FakeStore()
    entries = []
    for node in ("a", "b", "c"):
        key = payload_key("", "run", 0, node)
        store.objects[key] = node.encode() * 10
        entries.append(ManifestEntry(node_id=node, key=key, sha256="0" * 64, size=10))
    transfers = store.transfers("me")
    transfers.plan.blocked = asyncio.Event()  # a and c hang until cancelled
    transfers.plan.missing = {entries[1].key}  # b fails at once
    manifest = Manifest(
        run_id="run",
        round=0,
        base_fingerprint=None,
        gather=entries,
        excluded={},
        opened_at=0.0,
        closed_at=1.0,
    )
    view = ManifestView(
        signed=SignedManifest(manifest=manifest, signature="0" * 128),
        urls={e.node_id: store.presign_get(e.key) for e in entries},
    )
    with pytest.raises(TransferError) as failed:
        async with asyncio.timeout(10):
            await fetch_gather(transfers, view, manifest, parallel=8)
    assert failed.value.status == 404
    assert transfers.plan.cancelled == 2


async def test_a_payload_swapped_in_the_store_is_rejected_by_its_owner_too(harness) -> None:
    # Someone with the store's credentials replaces node-0's payload right after the coordinator
    # checked it at the submit: every peer rejects it as a bad digest, and node-0 must not
    # aggregate its own bytes from memory.
    run = run_config(min_nodes=2, rounds=2)
    h = harness(run)
    key = payload_key("", run.run_id, 0, "node-0")
    check = h.store.matches

    def check_then_swap(k: str, size: int, sha256: str) -> bool:
        ok = check(k, size, sha256)
        if k == key:
            h.store.objects[key] = bytes(size)  # same size, other bytes
        return ok

    h.store.matches = check_then_swap
    tasks = [h.start(h.daemon("node-0")), h.start(h.daemon("node-1"))]
    await h.advance_until(lambda: all(t.done() for t in tasks), step_s=5)
    assert [t.result() for t in tasks] == [0, 0]
    reports = h.reports(0)
    for node in ("node-0", "node-1"):
        assert reports[node].rejected.get("node-0", "").startswith("bad digest"), reports[node]
    assert reports["node-0"].fingerprint == reports["node-1"].fingerprint
    mass = reports["node-0"].mass
    assert mass is not None and mass.sent == 0.0  # its contribution stayed in its error buffer


async def test_a_swapped_checkpoint_falls_back_to_the_one_before(harness, caplog) -> None:
    """The newest checkpoint's object changed in the store after the coordinator verified it:
    a joiner refuses it, loads the one before, and replays the rounds since from payloads."""
    caplog.set_level(logging.INFO, logger="sparseloco")
    run = run_config(rounds=6, min_nodes=1, checkpoint_every=2)
    h = harness(run)
    assert await h.daemon("node-0").run(handle_signals=False) == 0
    newest = h.coord.book.latest()
    assert newest is not None and newest.round == run.rounds
    h.store.objects[newest.key] = b"\0" * newest.size  # same size, other bytes

    assert await h.daemon("node-1").run(handle_signals=False) == 0
    rejected = [m for m in caplog.messages if "event=checkpoint_rejected node=node-1" in m]
    loaded = [m for m in caplog.messages if "event=checkpoint_loaded node=node-1" in m]
    assert len(rejected) == 1 and f"round={run.rounds} " in rejected[0]
    assert len(loaded) == 1 and f"round={run.rounds - 2} " in loaded[0]
    theta = worker(run).shapes
    assert h.saved_fingerprint("node-1", theta) == h.saved_fingerprint("node-0", theta)


def _is_transfers(real: HttpTransfers, fake: NodeTransfers) -> list[Transfers]:
    """Both sides of the seam are ``Transfers`` (checked by mypy, which runs on the tests)."""
    return [real, fake]


async def test_the_fake_moves_files_as_the_real_transfers_do(tmp_path: Path) -> None:
    store = FakeStore()
    body = b"theta" * 1000
    sha = hashlib.sha256(body).hexdigest()
    source = tmp_path / "up.safetensors"
    source.write_bytes(body)
    url = store.presign_put("ckpt/model.safetensors", len(body), sha)
    transfers = store.transfers("node-0")
    assert await transfers.put_file(url, {}, source, size=len(body)) is True
    assert await transfers.put_file(url, {}, source, size=len(body)) is False  # write-once
    with pytest.raises(TransferError, match="not 4999"):
        await transfers.put_file(url, {}, source, size=len(body) - 1)
    get = store.presign_get("ckpt/model.safetensors")
    target = tmp_path / "down.safetensors"
    await transfers.get_to_file(get, target, size=len(body), sha256=sha)
    assert target.read_bytes() == body
    with pytest.raises(DigestError):
        await transfers.get_to_file(get, tmp_path / "bad", size=len(body), sha256="0" * 64)
    transfers.plan.failing = 1
    with pytest.raises(RetriesExhausted):
        await transfers.get_to_file(get, tmp_path / "bad", size=len(body), sha256=sha)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["down.safetensors", "up.safetensors"]
