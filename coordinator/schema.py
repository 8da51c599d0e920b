"""The coordinator database's tables, and how its file is opened.

One SQLite file in the state directory (``DB_FILE``), in WAL mode with full sync, so a commit
survives a crash of the process or the machine. The tables::

    meta                 run id, run config, how far publishing and retention got
    members              every node that ever joined: slot, state, the round it joined or left
    rounds               every round: state, times, deadline, base fingerprint, signed manifest
    submissions          each node's submission to a round, in arrival order (``seq``)
    reports              each node's report after applying a closed round (first one kept)
    checkpoint_grants    who may upload the checkpoint of a round, until when
    checkpoints          committed checkpoints, and whether published and pruned

Kept apart from ``coordinator.db`` (the typed reads and writes) so the layout reads in one place.
Tables are created if missing; nothing migrates yet (``SCHEMA_VERSION`` is 1).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

DB_FILE = "coordinator.sqlite"
SCHEMA_VERSION = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members (
    node_id TEXT PRIMARY KEY,
    slot INTEGER NOT NULL UNIQUE,
    state TEXT NOT NULL,
    joined_round INTEGER NOT NULL,
    gone_in_round INTEGER,
    client TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS rounds (
    round INTEGER PRIMARY KEY,
    state TEXT NOT NULL,
    started_at REAL,
    deadline REAL,
    closed_at REAL,
    base_fingerprint TEXT,
    signed_manifest TEXT,
    published INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS submissions (
    round INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    size INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    base_fingerprint TEXT NOT NULL,
    rejected TEXT,
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
    pruned INTEGER NOT NULL DEFAULT 0
);
"""


def connect(path: Path) -> sqlite3.Connection:
    """Open (or create) the database at ``path`` with its tables, in autocommit mode.

    Transactions are explicit (``Database.tx``), so nothing commits by accident.
    """
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.executescript(SCHEMA)
    return conn
