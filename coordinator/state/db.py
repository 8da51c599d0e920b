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
when a transaction fails. This module is its typed reads and writes, returning the frozen row
types of ``coordinator.state.rows``; the tables themselves and how the file is opened are
``coordinator.state.schema``; the checkpoint tables' part is ``coordinator.state.checkpoint_rows``.
The node tokens' table is read and written by ``coordinator.rules.tokens`` through ``execute``, so
the secrets' handling stays in one module; the counters' totals at start are summed by
``coordinator.monitoring.metrics`` the same way.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from coordinator.state.checkpoint_rows import CheckpointTables
from coordinator.state.rows import CheckpointRow, GrantRow, MemberRow, RoundRow, SubmissionRow
from coordinator.state.schema import connect
from protocol.messages import Exclusion, MemberState, RoundState

__all__ = ["CheckpointRow", "Database", "GrantRow", "MemberRow", "RoundRow", "SubmissionRow"]


#: Meta key prefix of retention's persistent deletion counts (``deleted.payload``).
DELETED = "deleted."


class Database(CheckpointTables):
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
        #: Called after a rollback, so in-memory views of the tables can be rebuilt.
        self.on_rollback: list[Callable[[], None]] = [self._forget_newest]
        #: The newest round's row, read once and dropped by every write to the rounds table:
        #: every request asks for it, and only this connection writes rounds (the token
        #: commands of other processes never do).
        self._newest: RoundRow | None = None

    def _forget_newest(self) -> None:
        self._newest = None

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

    # meta
    def get_meta(self, key: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._conn.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=?",
            (key, value, value),
        )

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

    # rounds
    @staticmethod
    def _round(row: Any) -> RoundRow | None:
        if row is None:
            return None
        return RoundRow(
            round=int(row[0]),
            state=RoundState(row[1]),
            started_at=row[2],
            deadline=row[3],
            closed_at=row[4],
            base_fingerprint=row[5],
            signed_manifest=row[6],
            published=bool(row[7]),
        )

    _ROUND_COLS = (
        "round, state, started_at, deadline, closed_at, base_fingerprint, signed_manifest,"
        " published"
    )

    def current_round(self) -> RoundRow | None:
        """The newest round (the one in progress, or the last closed one when finished)."""
        if self._newest is None:
            self._newest = self._round(
                self._conn.execute(
                    f"SELECT {self._ROUND_COLS} FROM rounds ORDER BY round DESC LIMIT 1"
                ).fetchone()
            )
        return self._newest

    def get_round(self, round_: int) -> RoundRow | None:
        return self._round(
            self._conn.execute(
                f"SELECT {self._ROUND_COLS} FROM rounds WHERE round=?", (round_,)
            ).fetchone()
        )

    def round_state(self, round_: int) -> RoundState | None:
        """The state of ``round_`` (``None`` if there is no such round), without its manifest."""
        row = self._conn.execute("SELECT state FROM rounds WHERE round=?", (round_,)).fetchone()
        return None if row is None else RoundState(row[0])

    def recent_rounds(self, n: int) -> list[RoundRow]:
        rows = self._conn.execute(
            f"SELECT {self._ROUND_COLS} FROM rounds ORDER BY round DESC LIMIT ?", (n,)
        ).fetchall()
        return [r for r in (self._round(row) for row in reversed(rows)) if r is not None]

    def closed_durations(self, n: int) -> list[float]:
        """How long the newest ``n`` closed rounds took to settle (open to their last valid
        submission, ``rounds.settled_at``; open to close for rounds closed before it was
        kept), oldest first."""
        rows = self._conn.execute(
            "SELECT COALESCE(settled_at, closed_at) - started_at FROM rounds WHERE state=?"
            " ORDER BY round DESC LIMIT ?",
            (RoundState.CLOSED.value, n),
        ).fetchall()
        return [float(r[0]) for r in reversed(rows)]

    def insert_round(
        self, round_: int, state: RoundState, started_at: float | None, deadline: float | None
    ) -> None:
        self._newest = None
        self._conn.execute(
            "INSERT INTO rounds(round, state, started_at, deadline) VALUES(?,?,?,?)",
            (round_, state.value, started_at, deadline),
        )

    def open_round(self, round_: int, started_at: float, deadline: float) -> bool:
        self._newest = None
        cur = self._conn.execute(
            "UPDATE rounds SET state=?, started_at=?, deadline=? WHERE round=? AND state=?",
            (RoundState.OPEN.value, started_at, deadline, round_, RoundState.WAITING.value),
        )
        return cur.rowcount == 1

    def set_deadline(self, round_: int, deadline: float) -> None:
        """Move open ``round_``'s deadline (a held round gathering, a store outage)."""
        self._newest = None
        self._conn.execute(
            "UPDATE rounds SET deadline=? WHERE round=? AND state=?",
            (deadline, round_, RoundState.OPEN.value),
        )

    def arrival_spreads(self, n: int) -> list[float]:
        """Seconds from the first to the last accepted submission of each of the newest ``n``
        closed rounds that had two or more, oldest first."""
        rows = self._conn.execute(
            "SELECT MAX(s.at) - MIN(s.at) FROM submissions s JOIN rounds r ON r.round = s.round"
            " WHERE r.state=? AND s.rejected IS NULL AND s.at IS NOT NULL GROUP BY s.round"
            " HAVING COUNT(*) >= 2 ORDER BY s.round DESC LIMIT ?",
            (RoundState.CLOSED.value, n),
        ).fetchall()
        return [float(r[0]) for r in reversed(rows)]

    def close_round(
        self,
        round_: int,
        closed_at: float,
        base: str | None,
        signed_manifest: str,
        settled_at: float | None = None,
    ) -> bool:
        """Mark an open round closed; ``False`` (and no change) if it was not open."""
        self._newest = None
        cur = self._conn.execute(
            "UPDATE rounds SET state=?, closed_at=?, base_fingerprint=?, signed_manifest=?,"
            " settled_at=? WHERE round=? AND state=?",
            (
                RoundState.CLOSED.value,
                closed_at,
                base,
                signed_manifest,
                settled_at,
                round_,
                RoundState.OPEN.value,
            ),
        )
        return cur.rowcount == 1

    def adopt_round(
        self, round_: int, started_at: float, closed_at: float, base: str | None, signed: str
    ) -> bool:
        """Mark a round this database has not closed as closed by ``signed``, a manifest the
        store already holds (``coordinator.store.catchup``); ``False`` if it is closed here."""
        self._newest = None
        closed = RoundState.CLOSED.value
        cur = self._conn.execute(
            "UPDATE rounds SET state=?, started_at=?, closed_at=?, base_fingerprint=?,"
            " signed_manifest=?, published=1 WHERE round=? AND state!=?",
            (closed, started_at, closed_at, base, signed, round_, closed),
        )
        return cur.rowcount == 1

    def unpublished(self) -> list[tuple[int, str]]:
        # published=0 first: the partial index rounds_unpublished
        # (coordinator.state.schema.INDEXES).
        rows = self._conn.execute(
            "SELECT round, signed_manifest FROM rounds WHERE published=0 AND state=?"
            " ORDER BY round",
            (RoundState.CLOSED.value,),
        ).fetchall()
        return [(int(r[0]), str(r[1])) for r in rows]

    def mark_published(self, round_: int) -> None:
        self._newest = None
        self._conn.execute("UPDATE rounds SET published=1 WHERE round=?", (round_,))

    # submissions
    _SUBMISSION_COLS = "round, node_id, seq, size, sha256, base_fingerprint, rejected, at"

    @staticmethod
    def _submission(r: Any) -> SubmissionRow:
        return SubmissionRow(
            round=r[0],
            node_id=r[1],
            seq=r[2],
            size=r[3],
            sha256=r[4],
            base_fingerprint=r[5],
            rejected=None if r[6] is None else Exclusion(r[6]),
            at=r[7],
        )

    def submissions(self, round_: int) -> list[SubmissionRow]:
        rows = self._conn.execute(
            f"SELECT {self._SUBMISSION_COLS} FROM submissions WHERE round=? ORDER BY seq",
            (round_,),
        )
        return [self._submission(r) for r in rows]

    def submission(self, round_: int, node_id: str) -> SubmissionRow | None:
        """One node's submission to a round: one lookup in the primary key."""
        row = self._conn.execute(
            f"SELECT {self._SUBMISSION_COLS} FROM submissions WHERE round=? AND node_id=?",
            (round_, node_id),
        ).fetchone()
        return None if row is None else self._submission(row)

    def add_submission(
        self,
        round_: int,
        node_id: str,
        size: int,
        sha256: str,
        base: str,
        rejected: Exclusion | None,
        at: float | None = None,
    ) -> int:
        # Sequence numbers are 0, 1, 2... per round: the next is the largest plus one, read from
        # the end of the (round, seq) index instead of counting the round's rows.
        (seq,) = self._conn.execute(
            "SELECT COALESCE(MAX(seq) + 1, 0) FROM submissions WHERE round=?", (round_,)
        ).fetchone()
        self._conn.execute(
            "INSERT INTO submissions(round, node_id, seq, size, sha256, base_fingerprint,"
            " rejected, at) VALUES(?,?,?,?,?,?,?,?)",
            (
                round_,
                node_id,
                seq,
                size,
                sha256,
                base,
                None if rejected is None else rejected.value,
                at,
            ),
        )
        return int(seq)

    def submitters(self, first: int, last: int) -> set[str]:
        """Node ids with a submission (any, even a rejected one) to a round in [first, last]."""
        rows = self._conn.execute(
            "SELECT DISTINCT node_id FROM submissions WHERE round BETWEEN ? AND ?", (first, last)
        )
        return {str(r[0]) for r in rows}

    # reports
    def record_report(self, round_: int, node_id: str, fingerprint: str, report_json: str) -> bool:
        """Record a node's report of a round; its first report stays. True if this was it.

        A node that resynchronises replays rounds it already reported; the first report (what
        it held when it took part, with its mass account and timings) is the history to keep,
        including a fingerprint that was wrong at the time.
        """
        cur = self._conn.execute(
            "INSERT INTO reports(round, node_id, fingerprint, report) VALUES(?,?,?,?)"
            " ON CONFLICT(round, node_id) DO NOTHING",
            (round_, node_id, fingerprint, report_json),
        )
        return cur.rowcount == 1

    def reported_fingerprints(self, round_: int) -> dict[str, str]:
        """Node id -> the fingerprint it reported after applying ``round_``."""
        rows = self._conn.execute(
            "SELECT node_id, fingerprint FROM reports WHERE round=? ORDER BY node_id", (round_,)
        )
        return {str(r[0]): str(r[1]) for r in rows}

    def count_reports(self, round_: int) -> int:
        """How many reports of ``round_`` are stored (anyone's)."""
        (n,) = self._conn.execute(
            "SELECT COUNT(*) FROM reports WHERE round=?", (round_,)
        ).fetchone()
        return int(n)

    def reports(self, round_: int) -> dict[str, dict[str, object]]:
        """Node id -> its stored report of ``round_`` as parsed JSON (the caller validates it)."""
        rows = self._conn.execute(
            "SELECT node_id, report FROM reports WHERE round=? ORDER BY node_id", (round_,)
        )
        return {str(r[0]): json.loads(r[1]) for r in rows}

    # retention's counts
    def add_deleted(self, kind: str, n: int) -> None:
        """Add ``n`` to retention's persistent count of deleted ``kind`` objects."""
        self._conn.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?)"
            " ON CONFLICT(key) DO UPDATE SET value=CAST(value AS INTEGER) + ?",
            (DELETED + kind, str(n), n),
        )
