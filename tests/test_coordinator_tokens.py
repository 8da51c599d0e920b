"""Node tokens in the coordinator's database: hashed, seeded by rule, revoked while it runs.

The table and the server's cached view are tested directly on a database file; the admin
commands' functions run on a second connection to the file of a running app, as the CLI process
does, and the running app is checked over HTTP (``make_api``): a revoked token is refused with
``token_revoked`` at once, and the open round stops waiting for its node.
"""

from __future__ import annotations

import hmac
import logging
import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from coordinator.base.errors import ApiError, TokenAdminError
from coordinator.ops import admin
from coordinator.rules.tokens import TokenBook, TokenSource, TokenState, TokenTable, digest
from coordinator.state.db import Database
from coordinator.state.schema import DB_FILE, SCHEMA_VERSION
from protocol.errors import ConfigError
from protocol.runconfig import RunConfig
from support.api import FP_A, ApiFactory, token

A = "token-of-alice-0123456789abcdef"
B = "token-of-bob-0123456789abcdef01"


@pytest.fixture
def db(tmp_path: Path) -> Any:
    database = Database(tmp_path / DB_FILE)
    yield database
    database.close()


def test_tokens_are_stored_as_digests_only(db: Database, tmp_path: Path) -> None:
    TokenTable(db).seed({"alice": A, "bob": B}, now=100.0)
    rows = TokenTable(db).rows()
    assert [(r.node_id, r.state, r.source) for r in rows] == [
        ("alice", TokenState.ACTIVE, TokenSource.CONFIG),
        ("bob", TokenState.ACTIVE, TokenSource.CONFIG),
    ]
    assert rows[0].digest == digest(A) != A
    db.close()
    on_disk = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert A.encode() not in on_disk and B.encode() not in on_disk


def test_authentication_compares_every_digest(db: Database, monkeypatch: Any) -> None:
    TokenTable(db).seed({"alice": A, "bob": B}, now=1.0)
    book = TokenBook(db, clock=lambda: 5.0)
    compared: list[str] = []
    real = hmac.compare_digest

    def spy(a: str, b: str) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    assert book.authenticate(A) == "alice"
    assert len(compared) == 2  # no early exit once alice matched
    with pytest.raises(ApiError) as info:
        book.authenticate("nope" * 8)
    assert (info.value.status, info.value.code) == (401, "unauthorized")


def test_revoked_token_is_refused_with_its_own_code(db: Database) -> None:
    TokenTable(db).seed({"alice": A}, now=1.0)
    book = TokenBook(db)
    assert book.authenticate(A) == "alice"
    other = Database(db.path)  # the CLI's connection
    try:
        assert admin.revoke(TokenTable(other), "alice", now=2.0) == 1
    finally:
        other.close()
    with pytest.raises(ApiError) as info:
        book.authenticate(A)  # the counter moved: the cache reloads on this very request
    assert (info.value.status, info.value.code) == (401, "token_revoked")
    assert book.take_revoked() == {"alice"} and book.take_revoked() == set()


def test_config_seeding_rule(db: Database, caplog: pytest.LogCaptureFixture) -> None:
    table = TokenTable(db)
    table.seed({"alice": A}, now=1.0)
    admin.revoke(table, "alice", now=2.0)
    caplog.set_level(logging.INFO, "sparseloco.coordinator.tokens")
    # A restart with the same config: the revoked token does not come back.
    table.seed({"alice": A}, now=3.0)
    assert [r.state for r in table.of("alice")] == [TokenState.REVOKED]
    assert "event=config_token_revoked node=alice" in caplog.text
    # A changed config token for a node the database knows is ignored, with the fix named.
    table.seed({"alice": B}, now=4.0)
    assert [r.digest for r in table.of("alice")] == [digest(A)]
    assert "token revoke|add alice" in caplog.text
    # A new node in the config is added; no log line shows a token.
    table.seed({"alice": B, "carol": "token-of-carol-0123456789"}, now=5.0)
    assert [r.state for r in table.of("carol")] == [TokenState.ACTIVE]
    assert A not in caplog.text and B not in caplog.text


def test_admin_add_and_revoke_rules(db: Database) -> None:
    table = TokenTable(db)
    first = admin.add(table, "dave", now=1.0)
    assert len(first) >= 32 and TokenBook(db).authenticate(first) == "dave"
    with pytest.raises(TokenAdminError, match="already has an active token"):
        admin.add(table, "dave", now=2.0)
    with pytest.raises(TokenAdminError, match="invalid node id"):
        admin.add(table, "not ok!", now=2.0)
    assert admin.revoke(table, "dave", now=3.0) == 1
    with pytest.raises(TokenAdminError, match="no active token"):
        admin.revoke(table, "dave", now=4.0)
    second = admin.add(table, "dave", now=5.0)  # a new token after a revocation
    assert second != first and TokenBook(db).authenticate(second) == "dave"
    listing = admin.render(table.rows())
    assert first not in listing and second not in listing
    header, *lines = listing.splitlines()
    assert re.fullmatch(r"NODE +STATE +SOURCE +CREATED +LAST USED +REVOKED", header)
    assert [line.split()[:3] for line in lines] == [
        ["dave", "revoked", "cli"],
        ["dave", "active", "cli"],
    ]


def test_last_use_is_written_at_first_then_in_batches(db: Database) -> None:
    TokenTable(db).seed({"alice": A}, now=1.0)
    now = [10.0]
    book = TokenBook(db, clock=lambda: now[0])
    book.authenticate(A)
    book.flush_used()
    assert TokenTable(db).rows()[0].last_used == 10.0  # the first use shows at once
    now[0] = 12.0
    book.authenticate(A)
    book.flush_used()
    assert TokenTable(db).rows()[0].last_used == 10.0  # later ones at most every few seconds
    now[0] = 100.0
    book.authenticate(A)
    book.flush_used()
    assert TokenTable(db).rows()[0].last_used == 100.0


V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE members (node_id TEXT PRIMARY KEY, slot INTEGER NOT NULL UNIQUE,
    state TEXT NOT NULL, joined_round INTEGER NOT NULL, gone_in_round INTEGER,
    client TEXT NOT NULL DEFAULT '');
INSERT INTO meta VALUES ('run_id', 'old-run');
INSERT INTO members VALUES ('n0', 0, 'active', 0, NULL, 'test');
"""


def test_a_version_1_database_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / DB_FILE
    conn = sqlite3.connect(path)
    conn.executescript(V1_SCHEMA)
    conn.close()
    db = Database(path)
    try:
        (version,) = db.execute("PRAGMA user_version").fetchone()
        assert version == SCHEMA_VERSION == 4
        member = db.member("n0")
        assert member is not None and member.instance is None and member.slot == 0
        assert db.get_meta("run_id") == "old-run"
        assert TokenTable(db).rows() == []
    finally:
        db.close()
    Database(path).close()  # opening a current file again changes nothing


def test_a_newer_database_is_refused(tmp_path: Path) -> None:
    path = tmp_path / DB_FILE
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version=99")
    conn.close()
    with pytest.raises(ConfigError, match="newer than this coordinator"):
        Database(path)


@pytest.mark.asyncio
async def test_revoking_while_running_takes_the_node_out(
    make_api: ApiFactory, tmp_path: Path
) -> None:
    api = await make_api(RunConfig(name="revoke", min_nodes=2, rounds=5))
    for node in ("n0", "n1"):
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200
    await api.contribute("n0", 0, FP_A)
    cli = Database(tmp_path / "state" / DB_FILE)  # as `sparseloco coordinator token revoke n1`
    try:
        assert admin.revoke(TokenTable(cli), "n1", now=0.0) == 1
    finally:
        cli.close()
    status, body = await api.call("POST", "/v1/heartbeat", "n1")
    assert (status, body["error"]) == (401, "token_revoked")
    assert "revoked" in body["message"] and token("n1") not in body["message"]
    # The round waited for n1 (its deadline is minutes away); the ticker takes n1 out and it
    # closes without it.
    status, view = await api.manifest("n0", 0, wait=30)
    assert status == 200
    manifest = view["signed"]["manifest"]
    assert [e["node_id"] for e in manifest["gather"]] == ["n0"]
    assert manifest["excluded"] == {"n1": "revoked"}
    status, st = await api.call("GET", "/v1/status", None)
    assert {m["node_id"]: m["state"] for m in st["members"]} == {"n0": "active", "n1": "revoked"}


@pytest.mark.asyncio
async def test_a_token_added_while_running_can_join(make_api: ApiFactory, tmp_path: Path) -> None:
    api = await make_api(RunConfig(name="addtoken"))
    cli = Database(tmp_path / "state" / DB_FILE)
    try:
        new = admin.add(TokenTable(cli), "n7", now=0.0)
    finally:
        cli.close()
    resp = await api.client.post("/v1/join", json={}, headers={"Authorization": f"Bearer {new}"})
    body = await resp.json()
    assert resp.status == 200 and body["node_id"] == "n7"
