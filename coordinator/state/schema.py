"""The coordinator database's tables, and how its file is opened.

One SQLite file in the state directory (``DB_FILE``), in WAL mode with full sync, so a commit
survives a crash of the process or the machine. The tables::

    meta                 run id, run config, how far publishing and retention got, the tokens'
                         change counter, retention's deletion counts
    members              every node that ever joined: slot, state, the round it joined or left,
                         the process instance an active member is bound to
    tokens               every node token ever issued, as its sha256: node, state, source,
                         created, revoked, last used (``coordinator.rules.tokens``)
    rounds               every round: state, times, deadline, time budget, base fingerprint,
                         signed manifest
    submissions          each node's submission to a round, in arrival order (``seq``), when,
                         and the work it carries (steps, tokens)
    reports              each node's report after applying a closed round (first one kept)
    checkpoint_grants    who may upload the checkpoint of a round, until when
    checkpoints          committed checkpoints, whether published and pruned, and whether the
                         coordinator verified the file's fingerprint (every commit since v3)

Every lookup a request makes goes through a primary key or an index (``INDEXES``), so a
request costs the same with ten members or ten thousand.

Kept apart from ``coordinator.state.db`` (the typed reads and writes) so the layout reads in one
place. The version lives in SQLite's ``user_version``. A new file gets every table at the current
version; an older file is brought forward one step at a time (``MIGRATIONS``), each step in one
transaction, so a crash mid-upgrade leaves the old version intact. Version 1 files were never
stamped (their ``user_version`` is 0): a file with tables and version 0 is version 1. A file
newer than this code is refused rather than misread.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from protocol.errors import ConfigError

DB_FILE = "coordinator.sqlite"
SCHEMA_VERSION = 4

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    node_id TEXT PRIMARY KEY,
    slot INTEGER NOT NULL UNIQUE,
    state TEXT NOT NULL,
    joined_round INTEGER NOT NULL,
    gone_in_round INTEGER,
    client TEXT NOT NULL DEFAULT '',
    instance TEXT
);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER PRIMARY KEY,
    state TEXT NOT NULL,
    started_at REAL,
    deadline REAL,
    closed_at REAL,
    base_fingerprint TEXT,
    signed_manifest TEXT,
    published INTEGER NOT NULL DEFAULT 0,
    settled_at REAL,
    budget REAL
);
CREATE TABLE IF NOT EXISTS submissions (
    round INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    base_fingerprint TEXT NOT NULL,
    rejected TEXT,
    at REAL,
    steps INTEGER,
    tokens INTEGER,
    PRIMARY KEY (round, node_id),
    UNIQUE (round, seq)
);
CREATE TABLE IF NOT EXISTS reports (
    round INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    report TEXT NOT NULL,
    PRIMARY KEY (round, node_id)
);
CREATE TABLE IF NOT EXISTS checkpoint_grants (
    round INTEGER PRIMARY KEY,
    node_id TEXT NOT NULL,
    body TEXT NOT NULL,
    expires_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    round INTEGER PRIMARY KEY,
    info TEXT NOT NULL,
    published INTEGER NOT NULL DEFAULT 0,
    pruned INTEGER NOT NULL DEFAULT 0,
    verified INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS tokens (
    hash TEXT PRIMARY KEY,
    node_id TEXT NOT NULL,
    state TEXT NOT NULL,
    source TEXT NOT NULL,
    created_at REAL NOT NULL,
    revoked_at REAL,
    last_used REAL
);
CREATE INDEX IF NOT EXISTS tokens_by_node ON tokens(node_id);
"""

#: Indexes beyond the keys, made at every open when missing. An index changes no table, so it
#: needs no schema version: an older coordinator reads a file that has one, and a file from an
#: older one gets it the first time this code opens it.
INDEXES = (
    # The closed rounds whose manifest is not in the store yet: the publisher's backlog after
    # every close, without reading every round of a long run.
    "CREATE INDEX IF NOT EXISTS rounds_unpublished ON rounds(round) WHERE published=0",
)

#: Statements that bring a file of version ``v`` to ``v + 1``, keyed by ``v``.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    # 1 -> 2: node tokens in the database (the table comes from SCHEMA), instance binding.
    1: ("ALTER TABLE members ADD COLUMN instance TEXT",),
    # 2 -> 3: when each submission arrived and when each round's work was in (deadlines learn
    # from honest arrivals); whether a checkpoint was verified (older ones were not).
    2: (
        "ALTER TABLE submissions ADD COLUMN at REAL",
        "ALTER TABLE rounds ADD COLUMN settled_at REAL",
        "ALTER TABLE checkpoints ADD COLUMN verified INTEGER NOT NULL DEFAULT 0",
    ),
    # 3 -> 4: each round's time budget; the work each submission carries (steps, tokens).
    3: (
        "ALTER TABLE rounds ADD COLUMN budget REAL",
        "ALTER TABLE submissions ADD COLUMN steps INTEGER",
        "ALTER TABLE submissions ADD COLUMN tokens INTEGER",
    ),
}


def connect(path: Path, *, synchronous: str = "FULL") -> sqlite3.Connection:
    """Open (or create) the database at ``path`` with its tables, in autocommit mode.

    Transactions are explicit (``Database.tx``), so nothing commits by accident.
    ``synchronous`` is ``FULL`` (every commit waits for the disk) or ``NORMAL`` (the caller
    syncs and checkpoints the write-ahead log itself: ``coordinator.state.durability``).
    """
    if synchronous not in ("FULL", "NORMAL"):
        raise ValueError(f"synchronous must be FULL or NORMAL, not {synchronous!r}")
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    if synchronous == "NORMAL":
        # The caller also checkpoints (copies the log into the main file, with two fsyncs) on
        # its own thread, so a commit on the event loop never does.
        conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("PRAGMA foreign_keys=ON")
    try:
        _upgrade(conn, path)
        for statement in INDEXES:
            conn.execute(statement)
    except BaseException:
        conn.close()
        raise
    return conn


def schema_version(conn: sqlite3.Connection) -> int:
    """The file's schema version: ``user_version``, or 1 for an unstamped file with tables."""
    (stamped,) = conn.execute("PRAGMA user_version").fetchone()
    if stamped:
        return int(stamped)
    (tables,) = conn.execute(
        "SELECT COUNT(*) FROM sqlite_master WHERE type='table' AND name='members'"
    ).fetchone()
    return 1 if tables else 0


def _upgrade(conn: sqlite3.Connection, path: Path) -> None:
    """Create the tables of a new file, or migrate an older one to ``SCHEMA_VERSION``."""
    version = schema_version(conn)
    if version > SCHEMA_VERSION:
        raise ConfigError(
            f"{path} has schema version {version}, newer than this coordinator's"
            f" {SCHEMA_VERSION}; run the newer coordinator, or use another --state-dir"
        )
    if version == SCHEMA_VERSION:
        return
    conn.execute("BEGIN IMMEDIATE")
    try:
        # Re-read under the write lock: another process may have upgraded the file meanwhile.
        version = schema_version(conn)
        if version:  # an existing file: one step at a time (a new one has nothing to migrate)
            for step in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[step]:
                    if _applies(conn, statement):
                        conn.execute(statement)
        if version < SCHEMA_VERSION:
            for statement in _statements(SCHEMA):
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _applies(conn: sqlite3.Connection, statement: str) -> bool:
    """Whether a migration statement applies: an ``ALTER TABLE t ADD COLUMN`` only to a table
    the file has (``SCHEMA`` then creates a missing table whole, new columns included)."""
    found = re.match(r"ALTER TABLE (\w+) ADD COLUMN", statement)
    if found is None:
        return True
    (n,) = conn.execute(
        "SELECT COUNT(*) FROM sqlite_master WHERE type='table' AND name=?", (found[1],)
    ).fetchone()
    return bool(n)


def _statements(script: str) -> list[str]:
    """The statements of ``script`` (``executescript`` would commit the open transaction)."""
    return [s.strip() for s in script.split(";") if s.strip()]
