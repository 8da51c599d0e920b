"""Votes and checkpoints come from members only, and a checkpoint is committed only once verified.

Through the HTTP API in-process (``make_api``) on the real store, as an attacker holding a valid
token would try it:

- a report from a token that never joined (or joined after the round) is refused with
  ``not_member`` and does not move the base-fingerprint majority, so it cannot get an honest
  node excluded as "wrong base fingerprint";
- a checkpoint grant or commit from such a token is refused with ``not_member``;
- an uploaded file that is not the offered θ (other tensors, or not safetensors at all) is
  refused with ``bad_checkpoint``, deleted, and its grant dropped so that another member may
  offer at once; nothing is pruned on its strength;
- the tally kept in memory follows every report written through the database, through this
  ``Votes`` or another one on it, and a base-fingerprint check uses it;
- ``GET /v1/checkpoints`` lists the committed ones, newest first, with working presigned GETs;
- retention relies on verified checkpoints only, and never deletes the newest verified one; a
  database from before verification keeps its checkpoints as unverified.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import ClientSession
from yarl import URL

from coordinator.rules.votes import Votes
from coordinator.state.db import CheckpointRow, Database
from coordinator.state.schema import DB_FILE, SCHEMA_VERSION
from coordinator.store.retention import (
    newest_verified,
    payload_rounds,
    replay_anchor,
    stale_checkpoints,
)
from protocol.messages import CheckpointInfo
from protocol.reports import RoundReport
from protocol.runconfig import RunConfig, Timing
from support.api import Api, ApiFactory
from support.theta_files import THETA, THETA_FP, offer, theta_file

F = THETA_FP
ZERO = "0" * 32  # sorts before F: it would win a tie of the vote
CALM = Timing(first_round_s=3600, min_round_s=3600, max_round_s=7200, heartbeat_timeout_s=1e6)


def run_config(**kw: Any) -> RunConfig:
    fields: dict[str, Any] = {"min_nodes": 2, **kw}
    return RunConfig(name="votes", rounds=20, checkpoint_every=2, timing=CALM, **fields)


async def put(url: str, headers: dict[str, str], body: bytes) -> int:
    async with (
        ClientSession() as http,
        http.put(URL(url, encoded=True), data=body, headers=headers) as r,
    ):
        return r.status


async def report(api: Api, node: str, round_: int, fingerprint: str = F) -> tuple[int, Any]:
    return await api.call("POST", f"/v1/rounds/{round_}/report", node, {"fingerprint": fingerprint})


async def play(api: Api, round_: int) -> None:
    """n0 and n1 contribute to ``round_``, it closes, both report F."""
    for node in ("n0", "n1"):
        assert (await api.contribute(node, round_, F))["accepted"]
    assert (await api.manifest("n0", round_))[0] == 200
    for node in ("n0", "n1"):
        assert (await report(api, node, round_))[0] == 200


async def start(make_api: ApiFactory, **fields: Any) -> Api:
    api = await make_api(run_config(), **fields)
    for node in ("n0", "n1"):
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200
    return api


@pytest.mark.asyncio
async def test_a_report_from_a_non_member_is_refused_and_not_counted(make_api: ApiFactory) -> None:
    api = await start(make_api)
    for node in ("n0", "n1"):
        assert (await api.contribute(node, 0, F))["accepted"]
    assert (await api.manifest("n0", 0))[0] == 200
    assert (await report(api, "n0", 0))[0] == 200
    # n2 holds a valid token but never joined: its made-up vote would tie with n0's and win.
    status, err = await report(api, "n2", 0, ZERO)
    assert (status, err["error"]) == (409, "not_member")
    # So n0, the fastest honest node, is not excluded for training from F.
    assert (await api.contribute("n0", 1, F)) == {"accepted": True, "reason": None}
    # Joining now does not give n2 a vote on round 0 either.
    assert (await api.call("POST", "/v1/join", "n2", {}))[0] == 200
    status, err = await report(api, "n2", 0, ZERO)
    assert (status, err["error"]) == (409, "not_member")
    status, st = await api.call("GET", "/v1/status", None)
    assert st["rounds"][0]["fingerprints"] == {"n0": F}


@pytest.mark.asyncio
async def test_the_tally_follows_every_report_written(make_api: ApiFactory) -> None:
    api = await make_api(run_config(min_nodes=3))
    for node in ("n0", "n1", "n2"):
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200
    for node in ("n0", "n1", "n2"):
        assert (await api.contribute(node, 0, F))["accepted"]
    assert (await api.manifest("n0", 0))[0] == 200
    votes = api.coord.machine.votes
    assert (await report(api, "n0", 0, F))[0] == 200
    assert votes.majority(0) == F  # counted, and kept
    assert (await report(api, "n1", 0, ZERO))[0] == 200
    assert (await report(api, "n1", 0, F))[0] == 200  # a second report of n1 does not count
    assert votes.tally(0) == {F: 1, ZERO: 1} and votes.majority(0) == ZERO  # a tie: smallest
    # A report written through another Votes on the same database: the kept tally is redone.
    Votes(api.coord.machine.db).record("n2", 0, RoundReport(fingerprint=F))
    assert votes.tally(0) == {F: 2, ZERO: 1}
    # And a submission to round 1 is checked against that majority: F is the base now.
    assert (await api.contribute("n0", 1, F)) == {"accepted": True, "reason": None}


@pytest.mark.asyncio
async def test_checkpoints_only_from_members_of_the_round(make_api: ApiFactory) -> None:
    api = await start(make_api)
    await play(api, 0)
    await play(api, 1)
    body = theta_file("n2's")
    for node_joined in (False, True):  # neither before nor after joining: it took no part in 1
        if node_joined:
            assert (await api.call("POST", "/v1/join", "n2", {}))[0] == 200
        for step in ("upload", "commit"):
            status, err = await api.call("POST", f"/v1/checkpoints/2/{step}", "n2", offer(body))
            assert (status, err["error"]) == (409, "not_member"), (step, node_joined)
    # A member of round 1 gets the grant: the race was never open to n2.
    status, grant = await api.call("POST", "/v1/checkpoints/2/upload", "n0", offer(body))
    assert status == 200, grant


@pytest.mark.asyncio
async def test_a_checkpoint_is_committed_only_once_verified(make_api: ApiFactory, s3: Any) -> None:
    api = await start(make_api)
    await play(api, 0)
    await play(api, 1)
    status, listed = await api.call("GET", "/v1/checkpoints", "n0")
    assert (status, listed) == (200, {"checkpoints": []})
    other = {name: t + 1 for name, t in THETA.items()}
    bad_files = {
        "other tensors": theta_file("lie", other),  # offered as F: its tensors say otherwise
        "not safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"{}" * 40,
        "float64": theta_file("f64", {k: t.to(torch.float64) for k, t in THETA.items()}),
    }
    key = None
    for why, bad in bad_files.items():
        status, grant = await api.call("POST", "/v1/checkpoints/2/upload", "n0", offer(bad))
        assert status == 200, (why, grant)
        key = grant["key"]
        assert await put(grant["url"], grant["headers"], bad) == 200
        status, err = await api.call("POST", "/v1/checkpoints/2/commit", "n0", offer(bad))
        assert (status, err["error"]) == (409, "bad_checkpoint"), (why, err)
        assert "Contents" not in s3.list_objects_v2(Bucket=api.config.storage.bucket, Prefix=key)
        status, err = await api.call("POST", "/v1/checkpoints/2/commit", "n0", offer(bad))
        assert (status, err["error"]) == (409, "not_granted")  # its grant went with it
    status, listed = await api.call("GET", "/v1/checkpoints", "n0")
    assert listed == {"checkpoints": []}
    assert api.coord.machine.db.get_meta("pruned_through") is None  # nothing pruned on them
    # The grant was dropped: another member offers at once (no wait for it to expire).
    good = theta_file("n1's")
    status, grant = await api.call("POST", "/v1/checkpoints/2/upload", "n1", offer(good))
    assert status == 200 and grant["key"] == key
    assert await put(grant["url"], grant["headers"], good) == 200
    status, info = await api.call("POST", "/v1/checkpoints/2/commit", "n1", offer(good))
    assert status == 200 and info["fingerprint"] == F, info
    assert api.coord.machine.db.checkpoints()[0].verified


@pytest.mark.asyncio
async def test_checkpoints_are_listed_newest_first(make_api: ApiFactory) -> None:
    api = await start(make_api)
    files: dict[int, bytes] = {}
    for r in range(5):
        if r in (2, 4):
            files[r] = theta_file(f"theta {r}")
            status, grant = await api.call(
                "POST", f"/v1/checkpoints/{r}/upload", "n0", offer(files[r])
            )
            assert await put(grant["url"], grant["headers"], files[r]) == 200
            status, _ = await api.call("POST", f"/v1/checkpoints/{r}/commit", "n0", offer(files[r]))
            assert status == 200
        await play(api, r)
    status, listed = await api.call("GET", "/v1/checkpoints", "n1")
    assert status == 200
    assert [v["info"]["round"] for v in listed["checkpoints"]] == [4, 2]
    for view in listed["checkpoints"]:
        CheckpointInfo.model_validate(view["info"])
        async with ClientSession() as http, http.get(URL(view["url"], encoded=True)) as resp:
            assert await resp.read() == files[view["info"]["round"]]
    status, err = await api.call("GET", "/v1/checkpoints", None)
    assert (status, err["error"]) == (401, "unauthorized")


def row(round_: int, *, verified: bool = True, pruned: bool = False) -> CheckpointRow:
    info = CheckpointInfo(
        run_id="r",
        round=round_,
        fingerprint=F,
        key=f"k{round_}",
        sha256="0" * 64,
        size=1,
        node_id="n0",
        created_at=0.0,
    )
    return CheckpointRow(info, published=True, pruned=pruned, verified=verified)


def test_retention_relies_on_verified_checkpoints_only() -> None:
    # Newest first, as the database lists them: 8 and 6 predate verification, 4 is verified.
    rows = [row(8, verified=False), row(6, verified=False), row(4), row(2)]
    assert newest_verified(rows) == 4
    assert stale_checkpoints(rows, keep=1) == [6, 2]  # 4 stays whatever keep says
    assert stale_checkpoints(rows, keep=2) == [2]
    # Payloads stay from the oldest verified checkpoint kept: a node may fall back to it.
    assert replay_anchor(rows, keep=1) == 4 and replay_anchor(rows, keep=4) == 2
    assert list(payload_rounds(-1, replay_anchor(rows, keep=1), 20, 3)) == list(range(4))
    assert replay_anchor([row(8, verified=False)], keep=2) is None
    assert newest_verified([row(8, verified=False)]) is None  # nothing to replay from: keep all
    assert newest_verified([row(6), row(4, pruned=True)]) == 6


V2_TABLES = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE members (node_id TEXT PRIMARY KEY, slot INTEGER NOT NULL UNIQUE, state TEXT NOT NULL,
    joined_round INTEGER NOT NULL, gone_in_round INTEGER, client TEXT NOT NULL DEFAULT '',
    instance TEXT);
CREATE TABLE rounds (round INTEGER PRIMARY KEY, state TEXT NOT NULL, started_at REAL,
    deadline REAL, closed_at REAL, base_fingerprint TEXT, signed_manifest TEXT,
    published INTEGER NOT NULL DEFAULT 0);
CREATE TABLE submissions (round INTEGER NOT NULL, node_id TEXT NOT NULL, seq INTEGER NOT NULL,
    size INTEGER NOT NULL, sha256 TEXT NOT NULL, base_fingerprint TEXT NOT NULL, rejected TEXT,
    PRIMARY KEY (round, node_id), UNIQUE (round, seq));
CREATE TABLE checkpoints (round INTEGER PRIMARY KEY, info TEXT NOT NULL,
    published INTEGER NOT NULL DEFAULT 0, pruned INTEGER NOT NULL DEFAULT 0);
INSERT INTO rounds VALUES (0, 'closed', 100.0, 400.0, 400.0, NULL, NULL, 1);
INSERT INTO submissions VALUES (0, 'n0', 0, 1, '%s', '%s', NULL);
INSERT INTO checkpoints VALUES (2, '%s', 1, 0);
PRAGMA user_version=2;
"""


def test_a_version_2_database_keeps_its_checkpoints_unverified(tmp_path: Path) -> None:
    info = row(2).info.model_dump_json()
    path = tmp_path / DB_FILE
    conn = sqlite3.connect(path)
    conn.executescript(V2_TABLES % ("0" * 64, F, info))
    conn.close()
    db = Database(path)
    try:
        (version,) = db.execute("PRAGMA user_version").fetchone()
        assert version == SCHEMA_VERSION == 4
        (old,) = db.checkpoints()
        assert old.info.round == 2 and not old.verified  # committed unverified: not relied on
        assert newest_verified(db.checkpoints()) is None
        assert db.submissions(0)[0].at is None
        assert db.closed_durations(5) == [300.0]  # open to close, as before
    finally:
        db.close()


def test_a_version_3_database_gains_budgets_and_work(tmp_path: Path) -> None:
    """Schema 3 -> 4: rounds get a budget, submissions their steps and tokens; the rows a
    version-3 file holds read back with none of them said."""
    path = tmp_path / DB_FILE
    db = Database(path)
    db.close()
    conn = sqlite3.connect(path)
    # A version-3 file: the same tables without the three columns.
    conn.executescript(
        "ALTER TABLE rounds DROP COLUMN budget; ALTER TABLE submissions DROP COLUMN steps;"
        " ALTER TABLE submissions DROP COLUMN tokens; PRAGMA user_version=3;"
        " INSERT INTO rounds(round, state, started_at, deadline) VALUES(0, 'open', 1.0, 9.0);"
        " INSERT INTO submissions(round, node_id, seq, size, sha256, base_fingerprint, at)"
        f" VALUES(0, 'a', 0, 10, '{'0' * 64}', '{F}', 2.0);"
    )
    conn.close()
    db = Database(path)
    try:
        (version,) = db.execute("PRAGMA user_version").fetchone()
        assert version == 4
        row = db.get_round(0)
        assert row is not None and row.budget is None
        (sub,) = db.submissions(0)
        assert (sub.steps, sub.tokens, sub.at) == (None, None, 2.0)
    finally:
        db.close()
