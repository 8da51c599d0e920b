"""The coordinator's persistent state: one SQLite database (WAL) in the state directory.

It holds the run id and config, the members, the rounds (with each closed round's signed
manifest), every submission in arrival order, the nodes' round reports, checkpoint upload grants
and committed checkpoints, and how far retention has pruned the store. Every state change
is one transaction committed before the HTTP response goes out, so a restart (or a crash) never
loses an answer a node has already seen. Heartbeat times are not stored: after a restart every
active member is given a fresh heartbeat window anyway.

The database is the single source of truth. The round machine and its helpers keep small
in-memory views of it (members, the open round's submitters, vote tallies) so that one request
costs O(1) reads, not a scan of the round; they register ``on_rollback`` to drop those views
when a transaction fails. ``Database`` is its typed reads and writes, returning the frozen row
types of ``coordinator.state.rows``: the connection, transactions, the meta and members tables
here, and one module per group of tables it inherits (``round_rows``: rounds;
``submission_rows``: submissions and reports; ``checkpoint_rows``: grants and checkpoints). The
tables themselves and how the file is opened are ``coordinator.state.schema``. The node tokens'
table is read and written by ``coordinator.rules.tokens`` through ``execute``, so the secrets'
handling stays in one module; the counters' totals at start are summed by
``coordinator.monitoring.metrics`` the same way.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from coordinator.state.checkpoint_rows import CheckpointTables
from coordinator.state.round_rows import RoundTables
from coordinator.state.rows import CheckpointRow, GrantRow, MemberRow, RoundRow, SubmissionRow
from coordinator.state.schema import connect
from coordinator.state.submission_rows import SubmissionTables
from protocol.errors import ConfigError
from protocol.messages import MemberState, RoundState

__all__ = ["CheckpointRow", "Database", "GrantRow", "MemberRow", "RoundRow", "SubmissionRow"]


#: Meta key prefix of retention's persistent deletion counts (``deleted.payload``).
DELETED = "deleted."


class Database(RoundTables, SubmissionTables, CheckpointTables):
    """Typed queries over the coordinator's SQLite file. Not shared across threads.

    ``durable=False`` commits without waiting for the disk (SQLite's ``synchronous=NORMAL``): the
    running server then makes every commit durable itself before it answers, many commits with
    one fsync off the event loop (``coordinator.state.durability``). Every other user (the token
    commands, tests) keeps the default, a full sync inside every commit.
    """

    def __init__(self, path: Path, *, durable: bool = True) -> None:
        self.path = path
        self._conn = connect(path, synchronous="FULL" if durable else "NORMAL")
        self._depth = 0
        #: Writes of ``meta`` through this connection (``data_version`` does not count them).
        self.meta_writes = 0
        self.report_writes = 0
        #: Called after a rollback, so in-memory views of the tables can be rebuilt.
        self.on_rollback: list[Callable[[], None]] = [self._forget_newest]
        #: The newest round's row, read once and dropped by every write to the rounds table:
        #: every request asks for it, and only this connection writes rounds (the token
        #: commands of other processes never do).
        self._newest: RoundRow | None = None

    @property
    def changes(self) -> int:
        """Rows changed through this connection so far (what a durability barrier waits for)."""
        return self._conn.total_changes

    def close(self) -> None:
        self._conn.close()

    def execute(self, sql: str, params: tuple[object, ...] = ()) -> sqlite3.Cursor:
        """One statement on this connection, for tables another module owns (tokens)."""
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: list[tuple[object, ...]]) -> None:
        """One statement for each of ``rows``, in one call (the loop runs in SQLite, not here)."""
        self._conn.executemany(sql, rows)

    @contextmanager
    def tx(self) -> Iterator[None]:
        """One write transaction (nested calls join the outer one); rolled back on error."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._conn.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            for hook in self.on_rollback:
                hook()
            raise
        else:
            self._conn.execute("COMMIT")
        finally:
            self._depth = 0

    def data_version(self) -> int:
        """SQLite's ``PRAGMA data_version``: it moves when another connection (another
        process: ``sparseloco coordinator token``) commits, never for this one's commits."""
        return int(self._conn.execute("PRAGMA data_version").fetchone()[0])

    # meta
    def get_meta(self, key: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self.meta_writes += 1
        self._conn.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=?",
            (key, value, value),
        )

    def claim_run(self, run_id: str, run_config: str) -> bool:
        """Make an empty database run ``run_id``'s, its round 0 waiting (True), or check that it
        is already (False); ``ConfigError`` if it belongs to another run."""
        stored = self.get_meta("run_id")
        if stored is not None and stored != run_id:
            raise ConfigError(
                f"state dir {self.path.parent} belongs to run {stored}, not {run_id}"
                " (another config, or a run of another sparseloco protocol version, which"
                " cannot be continued); use a new --state-dir or the same config"
            )
        with self.tx():
            if stored is None:
                self.set_meta("run_id", run_id)
                self.set_meta("run_config", run_config)
                self.insert_round(0, RoundState.WAITING, None, None)
        return stored is None

    # members
    _MEMBER_COLS = "node_id, slot, state, joined_round, gone_in_round, instance"

    def members(self) -> list[MemberRow]:
        rows = self._conn.execute(f"SELECT {self._MEMBER_COLS} FROM members ORDER BY slot")
        return [MemberRow(r[0], r[1], MemberState(r[2]), *r[3:]) for r in rows]

    def member(self, node_id: str) -> MemberRow | None:
        row = self._conn.execute(
            f"SELECT {self._MEMBER_COLS} FROM members WHERE node_id=?", (node_id,)
        ).fetchone()
        return None if row is None else MemberRow(row[0], row[1], MemberState(row[2]), *row[3:])

    def add_member(self, node_id: str, joined_round: int, client: str) -> int:
        (slot,) = self._conn.execute("SELECT COUNT(*) FROM members").fetchone()
        self._conn.execute(
            "INSERT INTO members(node_id, slot, state, joined_round, client) VALUES(?,?,?,?,?)",
            (node_id, slot, MemberState.ACTIVE.value, joined_round, client),
        )
        return int(slot)

    def set_member(
        self, node_id: str, state: MemberState, joined_round: int, gone_in_round: int | None
    ) -> None:
        self._conn.execute(
            "UPDATE members SET state=?, joined_round=?, gone_in_round=? WHERE node_id=?",
            (state.value, joined_round, gone_in_round, node_id),
        )

    def bind_instance(self, node_id: str, instance: str | None) -> None:
        self._conn.execute("UPDATE members SET instance=? WHERE node_id=?", (instance, node_id))

    # retention's counts
    def add_deleted(self, kind: str, n: int) -> None:
        """Add ``n`` to retention's persistent count of deleted ``kind`` objects."""
        self._conn.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?)"
            " ON CONFLICT(key) DO UPDATE SET value=CAST(value AS INTEGER) + ?",
            (DELETED + kind, str(n), n),
        )
