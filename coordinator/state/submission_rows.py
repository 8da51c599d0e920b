"""The coordinator database's submissions and reports: what nodes sent for and after each round.

A part of ``coordinator.state.db.Database`` (which inherits it), like
``coordinator.state.checkpoint_rows``: every submission in arrival order (with its verdict and
time), and the first report each node made of each round it applied.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from coordinator.state.rows import SubmissionRow
from protocol.messages import Exclusion

_SUBMISSION_COLS = (
    "round, node_id, seq, size, sha256, base_fingerprint, rejected, at, steps, tokens"
)


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
        steps=r[8],
        tokens=r[9],
    )


class SubmissionTables:
    """Reads and writes of ``submissions`` and ``reports`` (on ``Database``)."""

    _conn: sqlite3.Connection
    #: Reports written through this connection (rolled back or not): what a tally in memory
    #: compares to see whether it may still be right (``coordinator.rules.votes``).
    report_writes: int

    def submissions(self, round_: int) -> list[SubmissionRow]:
        rows = self._conn.execute(
            f"SELECT {_SUBMISSION_COLS} FROM submissions WHERE round=? ORDER BY seq",
            (round_,),
        )
        return [_submission(r) for r in rows]

    def submission(self, round_: int, node_id: str) -> SubmissionRow | None:
        """One node's submission to a round: one lookup in the primary key."""
        row = self._conn.execute(
            f"SELECT {_SUBMISSION_COLS} FROM submissions WHERE round=? AND node_id=?",
            (round_, node_id),
        ).fetchone()
        return None if row is None else _submission(row)

    def add_submission(
        self,
        round_: int,
        node_id: str,
        size: int,
        sha256: str,
        base: str,
        rejected: Exclusion | None,
        at: float | None = None,
        steps: int | None = None,
        tokens: int | None = None,
    ) -> int:
        # Sequence numbers are 0, 1, 2... per round: the next is the largest plus one, read from
        # the end of the (round, seq) index instead of counting the round's rows.
        (seq,) = self._conn.execute(
            "SELECT COALESCE(MAX(seq) + 1, 0) FROM submissions WHERE round=?", (round_,)
        ).fetchone()
        verdict = None if rejected is None else rejected.value
        self._conn.execute(
            "INSERT INTO submissions(round, node_id, seq, size, sha256, base_fingerprint,"
            " rejected, at, steps, tokens) VALUES(?,?,?,?,?,?,?,?,?,?)",
            (round_, node_id, seq, size, sha256, base, verdict, at, steps, tokens),
        )
        return int(seq)

    def reject_submission(self, round_: int, node_id: str, reason: Exclusion) -> bool:
        """Turn an accepted submission into a rejected one (its object, confirmed after the
        answer, was not what it named); False if there was no accepted one."""
        cur = self._conn.execute(
            "UPDATE submissions SET rejected=? WHERE round=? AND node_id=? AND rejected IS NULL",
            (reason.value, round_, node_id),
        )
        return cur.rowcount == 1

    def submitters(self, first: int, last: int) -> set[str]:
        """Node ids with a submission (any, even a rejected one) to a round in [first, last]."""
        rows = self._conn.execute(
            "SELECT DISTINCT node_id FROM submissions WHERE round BETWEEN ? AND ?", (first, last)
        )
        return {str(r[0]) for r in rows}

    def record_report(self, round_: int, node_id: str, fingerprint: str, report_json: str) -> bool:
        """Record a node's report of a round; its first report stays. True if this was it.

        A node that resynchronises replays rounds it already reported; the first report (what
        it held when it took part, with its mass account and timings) is the history to keep,
        including a fingerprint that was wrong at the time.
        """
        self.report_writes += 1
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

    def reports(self, round_: int) -> dict[str, dict[str, object]]:
        """Node id -> its stored report of ``round_`` as parsed JSON (the caller validates it)."""
        rows = self._conn.execute(
            "SELECT node_id, report FROM reports WHERE round=? ORDER BY node_id", (round_,)
        )
        return {str(r[0]): json.loads(r[1]) for r in rows}
