"""Backups of a coordinator's state: consistent under writes, private, restorable, and a restored
coordinator that learns the rounds closed after its backup from the store.

Fast unit tests on real SQLite files and the real round machine; the store is a dict (only the
signed manifests matter here). The whole story with real processes, nodes included, is
``tests/test_coordinator_restore_run.py``.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import tarfile
import threading
from pathlib import Path

import pytest

from coordinator.base.config import CoordinatorConfig
from coordinator.base.errors import BackupError, StartupError
from coordinator.ops.backup_cli import main as backup_main
from coordinator.rules.machine import RoundMachine
from coordinator.state.backup import DB_FILE, KEY_FILE, restore_backup, take_backup
from coordinator.state.db import Database
from coordinator.state.signing import ManifestSigner
from coordinator.store.catchup import learn_closed_rounds
from protocol.keys import manifest_key
from protocol.messages import RoundState, SignedManifest, SubmitRequest
from protocol.runconfig import RunConfig, Timing

RUN = RunConfig(
    rounds=6,
    min_nodes=2,
    timing=Timing(first_round_s=10, min_round_s=5, max_round_s=20, heartbeat_timeout_s=30),
)
FP = "ab" * 16
NODES = ("n0", "n1")


def _new_state(state_dir: Path) -> tuple[Database, ManifestSigner, RoundMachine]:
    state_dir.mkdir(parents=True, exist_ok=True)
    db = Database(state_dir / DB_FILE)
    signer = ManifestSigner.load_or_create(state_dir)
    return db, signer, RoundMachine(db, RUN, signer, clock=lambda: 1000.0)


def _close_round(machine: RoundMachine, r: int) -> SignedManifest:
    """Both nodes submit to open round r, which then closes."""
    closed: list[SignedManifest] = []
    for node in NODES:
        req = SubmitRequest(size=10, sha256=f"{r:02d}" * 32, base_fingerprint=FP)
        closed += machine.submit(node, r, req, True)[1]
    assert [s.manifest.round for s in closed] == [r]
    return closed[0]


def _unpack(archive: Path, into: Path) -> dict[str, Path]:
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(into, filter="data")
        names = tar.getnames()
    return {name: into / name for name in names}


def test_a_backup_under_concurrent_writes_is_one_consistent_commit(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db, _, _ = _new_state(state)
    db.close()
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        # Every transaction adds one row and moves the counter with it: a copy taken between
        # the two, or of half a transaction, has them disagree.
        conn = sqlite3.connect(state / DB_FILE, isolation_level=None, timeout=30)
        conn.execute("CREATE TABLE IF NOT EXISTS filler (i INTEGER PRIMARY KEY, pad BLOB)")
        while not stop.is_set():
            i = written[0] + 1
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("INSERT INTO filler VALUES(?, ?)", (i, os.urandom(2048)))
            conn.execute(
                "INSERT INTO meta(key, value) VALUES('filler', ?)"
                " ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (str(i),),
            )
            conn.execute("COMMIT")
            written[0] = i
        conn.close()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        counts = []
        for k in range(4):
            while written[0] < 50 * (k + 1):  # keyed to the writer's progress, not to time
                threading.Event().wait(0.01)
            out = tmp_path / f"backup-{k}.tar.gz"
            committed = written[0]  # every one of these is in the database before the backup
            info = take_backup(state, out)
            assert stat.S_IMODE(out.stat().st_mode) == 0o600
            assert info.round == 0 and info.round_state == RoundState.WAITING.value
            files = _unpack(out, tmp_path / f"unpacked-{k}")
            assert set(files) == {"backup.json", DB_FILE, KEY_FILE}
            conn = sqlite3.connect(files[DB_FILE])
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            (rows,) = conn.execute("SELECT COUNT(*) FROM filler").fetchone()
            (counter,) = conn.execute("SELECT value FROM meta WHERE key='filler'").fetchone()
            conn.close()
            assert rows == int(counter) >= committed > 0  # one commit, and a recent one
            counts.append(rows)
    finally:
        stop.set()
        thread.join()
    assert counts == sorted(counts) and counts[-1] > counts[0]  # the writes went on meanwhile


def test_restore_gives_the_same_state_and_key_privately_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    db, _, machine = _new_state(state)
    for node in NODES:
        machine.join(node)
    _close_round(machine, 0)
    db.close()
    out = tmp_path / "b.tar.gz"
    assert backup_main("backup", ["--state-dir", str(state), "--out", str(out)], prog="t") == 0
    restored = tmp_path / "other-host" / "state"
    assert backup_main("restore", ["--from", str(out), "--state-dir", str(restored)], prog="t") == 0
    printed = capsys.readouterr()
    pem = (state / KEY_FILE).read_text()
    secret_line = pem.splitlines()[1]
    assert secret_line not in printed.out + printed.err  # the key is never shown
    assert "round 1 (open)" in printed.out
    for name in (DB_FILE, KEY_FILE):
        assert stat.S_IMODE((restored / name).stat().st_mode) == 0o600
    assert (restored / KEY_FILE).read_bytes() == (state / KEY_FILE).read_bytes()
    again = Database(restored / DB_FILE)
    try:
        row = again.get_round(0)
        assert row is not None and row.state == RoundState.CLOSED
        assert [m.node_id for m in again.members()] == list(NODES)
    finally:
        again.close()
    # A second restore over a state directory refuses, and so does a file that is not a backup.
    with pytest.raises(BackupError, match="already holds a coordinator database"):
        restore_backup(out, restored)
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tar")
    with pytest.raises(BackupError, match="cannot read"):
        restore_backup(junk, tmp_path / "fresh")
    nothing = ["--state-dir", str(tmp_path / "none"), "--out", str(out)]
    assert backup_main("backup", nothing, prog="t") == 1


class DictStore:
    """The one call the catch-up makes of an ``ObjectStore``."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    async def get_bytes(self, key: str, max_size: int) -> bytes | None:
        return self.objects.get(key)


def _config(state_dir: Path) -> CoordinatorConfig:
    return CoordinatorConfig(
        run=RUN,
        server={"state_dir": state_dir},
        storage={
            "endpoint_url": "http://store.invalid",
            "bucket": "bucket",
            "access_key": "a",
            "secret_key": "b",
        },
    )


def test_a_restored_coordinator_learns_the_rounds_closed_after_its_backup(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db, _, machine = _new_state(state)
    for node in NODES:
        machine.join(node)
    store = DictStore()
    run_id = RUN.run_id

    def publish(signed: SignedManifest) -> None:
        store.objects[manifest_key("", run_id, signed.manifest.round)] = (
            signed.model_dump_json().encode()
        )

    publish(_close_round(machine, 0))
    backup = tmp_path / "b.tar.gz"
    take_backup(state, backup)
    later = [_close_round(machine, r) for r in (1, 2)]  # after the backup: only in the store
    for signed in later:
        publish(signed)
    db.close()

    restored = tmp_path / "restored"
    restore_backup(backup, restored)
    assert asyncio.run(learn_closed_rounds(_config(restored), store)) == [1, 2]  # type: ignore[arg-type]
    db2 = Database(restored / DB_FILE)
    try:
        for signed in later:
            row = db2.get_round(signed.manifest.round)
            assert row is not None and row.state == RoundState.CLOSED and row.published
            assert row.signed_manifest == signed.model_dump_json()  # the very manifest applied
        machine2 = RoundMachine(db2, RUN, ManifestSigner.load_or_create(restored))
        assert machine2.round_number() == 3
        assert machine2.round_view_state() in (RoundState.OPEN, RoundState.WAITING)
    finally:
        db2.close()
    # Up to date now: a second start learns nothing.
    assert asyncio.run(learn_closed_rounds(_config(restored), store)) == []  # type: ignore[arg-type]


def test_a_manifest_in_the_store_signed_by_another_key_stops_the_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    db, _, machine = _new_state(state)
    for node in NODES:
        machine.join(node)
    db.close()
    _, _, stranger = _new_state(tmp_path / "stranger")
    for node in NODES:
        stranger.join(node)
    store = DictStore()
    forged = _close_round(stranger, 0)
    store.objects[manifest_key("", RUN.run_id, 0)] = forged.model_dump_json().encode()
    stranger.db.close()
    with pytest.raises(StartupError, match="did not sign"):
        asyncio.run(learn_closed_rounds(_config(state), store))  # type: ignore[arg-type]
