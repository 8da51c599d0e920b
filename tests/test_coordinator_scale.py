"""What keeps the coordinator O(N) per round, checked by what it does, never by how fast.

- answers wait for the disk in groups: many concurrent commits, fewer fsyncs, every answer after
  its own commit is synced; read-only answers do not wait;
- the manifest answer is built once per round: every reader gets the same bytes, with the
  download URLs presigned once, and rebuilt when they near half their lifetime;
- a round that waits for members can be long-polled (``GET /v1/round?wait=``), and the node's
  client long-polls it only after a "waiting" answer, falling back to plain requests when an
  older coordinator refuses the parameter;
- the close check, the members and the votes are kept in memory and stay right across a
  rollback and a restart;
- a token that authenticated once takes the fast path; a revocation ends it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from coordinator.rules.machine import RoundMachine
from coordinator.rules.tokens import TokenBook, TokenTable
from coordinator.state import durability
from coordinator.state.db import Database
from coordinator.state.durability import GroupSync
from coordinator.state.schema import DB_FILE
from coordinator.state.signing import ManifestSigner
from node.daemon.client import ClientTimeouts, CoordinatorClient
from node.daemon.retry import RetryPolicy
from protocol.messages import RoundState, SubmitRequest
from protocol.runconfig import RunConfig
from support.api import FP_A, ApiFactory

RUN = RunConfig(name="scaletest", min_nodes=2, rounds=3, gather_size=2)


def submit(machine: RoundMachine, node: str, round_: int = 0) -> None:
    req = SubmitRequest(size=10, sha256="0" * 64, base_fingerprint=FP_A)
    machine.submit(node, round_, req, digest_ok=True)


@pytest.mark.asyncio
async def test_group_sync_covers_many_commits_with_few_fsyncs(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(durability, "CHECKPOINT_BYTES", 0)  # checkpoint at every sync
    db = Database(tmp_path / DB_FILE, durable=False)
    sync = GroupSync(db)
    try:
        assert not sync.pending()
        await sync.barrier()  # nothing to sync: no fsync at all
        assert sync.syncs == 0

        async def commit_then_wait(i: int) -> None:
            with db.tx():
                db.set_meta(f"k{i}", str(i))
            mine = db.changes
            await sync.barrier()
            assert sync.synced >= mine  # its own commit is on disk before it goes on

        await asyncio.gather(*(commit_then_wait(i) for i in range(50)))
        assert not sync.pending()
        assert 1 <= sync.syncs < 50
        assert sync.checkpoints == sync.syncs  # on the sync thread, never in a commit
    finally:
        sync.close()
        db.close()
    reader = sqlite3.connect(tmp_path / DB_FILE)
    assert reader.execute("SELECT COUNT(*) FROM meta WHERE key LIKE 'k%'").fetchone() == (50,)
    reader.close()


@pytest.mark.asyncio
async def test_manifest_answer_is_built_once_per_round(make_api: ApiFactory) -> None:
    api = await make_api(RUN)
    for node in ("n0", "n1"):
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200
    for node in ("n0", "n1"):
        await api.contribute(node, 0, FP_A)

    # The round closes once the payloads are confirmed (one listing), just after the answer.
    async def closed() -> None:
        while api.coord.machine.manifest(0) is None:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(closed(), 30)
    store = api.coord.store
    calls: list[str] = []
    real = store.presign_get

    def counting(key: str) -> str:
        calls.append(key)
        return real(key)

    store.presign_get = counting  # type: ignore[method-assign]
    bodies = []
    for node in ("n0", "n1", "n0"):
        resp = await api.client.get(
            "/v1/rounds/0/manifest", headers={"Authorization": f"Bearer token-of-{node}-0123456789"}
        )
        assert resp.status == 200
        bodies.append(await resp.read())
    assert bodies[0] == bodies[1] == bodies[2]
    assert len(calls) == 2  # one URL per gathered payload, for every reader together
    # Past half the URLs' lifetime the answer is rebuilt with fresh URLs.
    body, _ = api.coord.manifests[0]
    api.coord.manifests[0] = (body, 0.0)
    status, _ = await api.manifest("n1", 0)
    assert status == 200 and len(calls) == 4


@pytest.mark.asyncio
async def test_waiting_round_long_poll_answers_when_it_opens(make_api: ApiFactory) -> None:
    api = await make_api(RUN)
    assert (await api.call("POST", "/v1/join", "n0", {}))[0] == 200
    status, view = await api.call("GET", "/v1/round", "n0")
    assert (status, view["state"]) == (200, "waiting")
    poll = asyncio.ensure_future(api.call("GET", "/v1/round?wait=30", "n0"))
    await asyncio.sleep(0)
    assert (await api.call("POST", "/v1/join", "n1", {}))[0] == 200  # min_nodes reached
    status, view = await asyncio.wait_for(poll, 30)
    assert (status, view["state"], view["expected"]) == (200, "open", True)
    # Open: a wait is answered at once; a bad one is refused, not clamped.
    status, view = await api.call("GET", "/v1/round?wait=30", "n0")
    assert (status, view["state"]) == (200, "open")
    status, body = await api.call("GET", "/v1/round?wait=-1", "n0")
    assert (status, body["field"]) == (422, "wait")


async def _fake_coordinator(handler: Any) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/v1/round", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def _view(state: str) -> dict[str, Any]:
    return {"run_id": "r", "round": 0, "state": state, "expected": state == "open"}


@pytest.mark.parametrize("old_server", [False, True])
@pytest.mark.asyncio
async def test_client_long_polls_only_a_waiting_round(old_server: bool) -> None:
    seen: list[str | None] = []
    states = iter(["waiting", "waiting", "open"])

    async def handler(request: web.Request) -> web.Response:
        wait = request.query.get("wait")
        seen.append(wait)
        if old_server and wait is not None:
            body = {"error": "invalid", "message": "unknown query parameter 'wait' (known: none)"}
            return web.json_response({**body, "field": "wait"}, status=422)
        return web.json_response(_view(next(states)))

    runner, url = await _fake_coordinator(handler)
    try:
        async with aiohttp.ClientSession() as session:
            client = CoordinatorClient(
                session,
                url,
                "t" * 20,
                timeouts=ClientTimeouts(round_wait_s=2.5),
                policy=RetryPolicy(attempts=1),
            )
            views = [await client.round() for _ in range(3)]
    finally:
        await runner.cleanup()
    assert [v.state for v in views] == [RoundState.WAITING, RoundState.WAITING, RoundState.OPEN]
    if old_server:  # refused once, then plain requests as before
        assert seen == [None, "2.5", None, None]
    else:
        assert seen == [None, "2.5", "2.5"]


def test_close_check_survives_rollback_and_restart(tmp_path: Path) -> None:
    signer = ManifestSigner.load_or_create(tmp_path)
    db = Database(tmp_path / DB_FILE)
    machine = RoundMachine(db, RUN, signer, clock=lambda: 100.0)
    for node in ("a", "b", "c"):
        machine.join(node)
    submit(machine, "a")
    with pytest.raises(RuntimeError), db.tx():
        db.add_submission(0, "b", 10, "0" * 64, FP_A, None)
        raise RuntimeError("rolled back")
    assert machine.progress.missing(0) == {"b", "c"}  # the rolled-back submission is not counted
    assert not machine.round_view("b").submitted
    db.close()
    db = Database(tmp_path / DB_FILE)
    machine = RoundMachine(db, RUN, signer, clock=lambda: 100.0)
    assert machine.progress.missing(0) == {"b", "c"}
    submit(machine, "b")
    machine.leave("c")  # a membership change: the round stops waiting for c and would close
    # ...once the submission made before the restart is confirmed again (one listing).
    assert machine.manifest(0) is None and machine.confirm_wanted() == (0, {"a": 10})
    assert machine.confirm(0, {"a"}, set()) and machine.manifest(0) is not None
    db.close()


def test_token_fast_path_ends_with_a_revocation(tmp_path: Path, monkeypatch: Any) -> None:
    db = Database(tmp_path / DB_FILE)
    table = TokenTable(db)
    tokens = {f"n{i}": f"token-number-{i:04d}-abcdef" for i in range(20)}
    table.seed(tokens, now=1.0)
    book = TokenBook(db, clock=lambda: 2.0)
    compared: list[str] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert book.authenticate(tokens["n3"]) == "n3"
    assert len(compared) == 20  # a first use: every digest
    compared.clear()
    assert book.authenticate(tokens["n3"]) == "n3"
    assert len(compared) == 1  # known since: one comparison
    with db.tx():
        table.revoke("n3", now=3.0)
    with pytest.raises(Exception) as refused:
        book.authenticate(tokens["n3"])
    assert getattr(refused.value, "code", None) == "token_revoked"
    db.close()


def test_an_older_file_gets_the_indexes(tmp_path: Path) -> None:
    path = tmp_path / DB_FILE
    Database(path).close()
    conn = sqlite3.connect(path)
    conn.execute("DROP INDEX rounds_unpublished")
    conn.commit()
    conn.close()
    db = Database(path)
    names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    plan = " ".join(
        str(r[-1])
        for r in db.execute(
            "EXPLAIN QUERY PLAN SELECT round FROM rounds WHERE published=0 AND state='closed'"
        )
    )
    db.close()
    assert "rounds_unpublished" in names and "rounds_unpublished" in plan


def test_bench_coordinator_runs_full_rounds(tmp_path: Path) -> None:
    """``sparseloco bench coordinator`` end to end at a small N: every node gets every manifest."""
    from node.cli import main

    out = tmp_path / "coord.json"
    argv = ["bench", "coordinator", "--nodes", "4", "--rounds", "2", "--train-s", "0.1"]
    argv += ["--spread-s", "0.1", "--apply-s", "0", "--join-s", "0.2", "--json", str(out)]
    assert main([*argv, "--dir", str(tmp_path / "run")]) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == {} and result["timed_out"] == 0
    assert [r["manifests"] for r in result["rounds"]] == [4, 4]
    assert {"join", "round", "upload", "put", "submit", "report"} <= set(result["latency"])
    # The probe's heartbeats give the heartbeat target samples even where the nodes sent none.
    assert result["latency"]["heartbeat_probe"]["n"] > 0 and result["heartbeat_p99_ms"] > 0
    # The light client's round views, timed in a process of its own (issue 36).
    light = result["light_client"]
    assert light["n"] > 0 and 0 < light["p50_ms"] <= light["p99_ms"] <= light["max_ms"]
    assert light["slowest"][0]["ms"] == round(light["max_ms"], 1)
    assert set(result["targets_met"]) == {"heartbeat", "submit", "manifest", "errors"}
