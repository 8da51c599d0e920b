"""The coordinator database's rounds table: each round's state, deadline and signed manifest.

A part of ``coordinator.state.db.Database`` (which inherits it), like
``coordinator.state.checkpoint_rows``. Every request asks for the newest round, so it is read
once and kept (``_newest``) until a write to the table drops it; only this connection writes
rounds (the token commands of other processes never do), and a rollback drops it too.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from coordinator.state.rows import RoundRow
from protocol.messages import RoundState

_ROUND_COLS = (
    "round, state, started_at, deadline, closed_at, base_fingerprint, signed_manifest, published,"
    " budget"
)


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
        budget=row[8],
    )


class RoundTables:
    """Reads and writes of ``rounds`` (on ``Database``)."""

    _conn: sqlite3.Connection
    #: The newest round's row, or ``None`` until it is read again.
    _newest: RoundRow | None

    def _forget_newest(self) -> None:
        self._newest = None

    def _change_rounds(self, sql: str, params: tuple[object, ...]) -> bool:
        """One write to the rounds table (the kept newest row goes); whether it changed a row."""
        self._newest = None
        return self._conn.execute(sql, params).rowcount == 1

    def current_round(self) -> RoundRow | None:
        """The newest round (the one in progress, or the last closed one when finished)."""
        if self._newest is None:
            self._newest = _round(
                self._conn.execute(
                    f"SELECT {_ROUND_COLS} FROM rounds ORDER BY round DESC LIMIT 1"
                ).fetchone()
            )
        return self._newest

    def get_round(self, round_: int) -> RoundRow | None:
        return _round(
            self._conn.execute(
                f"SELECT {_ROUND_COLS} FROM rounds WHERE round=?", (round_,)
            ).fetchone()
        )

    def round_state(self, round_: int) -> RoundState | None:
        """The state of ``round_`` (``None`` if there is no such round), without its manifest."""
        row = self._conn.execute("SELECT state FROM rounds WHERE round=?", (round_,)).fetchone()
        return None if row is None else RoundState(row[0])

    def recent_rounds(self, n: int) -> list[RoundRow]:
        rows = self._conn.execute(
            f"SELECT {_ROUND_COLS} FROM rounds ORDER BY round DESC LIMIT ?", (n,)
        ).fetchall()
        return [r for r in (_round(row) for row in reversed(rows)) if r is not None]

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

    def insert_round(
        self,
        round_: int,
        state: RoundState,
        started_at: float | None,
        deadline: float | None,
        budget: float | None = None,
    ) -> None:
        self._change_rounds(
            "INSERT INTO rounds(round, state, started_at, deadline, budget) VALUES(?,?,?,?,?)",
            (round_, state.value, started_at, deadline, budget),
        )

    def open_round(
        self, round_: int, started_at: float, deadline: float, budget: float | None = None
    ) -> bool:
        return self._change_rounds(
            "UPDATE rounds SET state=?, started_at=?, deadline=?, budget=? WHERE round=? AND"
            " state=?",
            (RoundState.OPEN.value, started_at, deadline, budget, round_, RoundState.WAITING.value),
        )

    def work_history(self, n: int) -> list[list[tuple[str, float, int | None]]]:
        """The newest ``n`` closed rounds' accepted submissions, oldest round first: per round,
        (node, seconds from the round's opening to its arrival, steps it carried). What the
        time budget learns from (``coordinator.rules.budget``)."""
        rows = self._conn.execute(
            "SELECT r.round, s.node_id, s.at - r.started_at, s.steps FROM rounds r"
            " JOIN submissions s ON s.round = r.round"
            " WHERE r.round IN (SELECT round FROM rounds WHERE state=? ORDER BY round DESC"
            " LIMIT ?) AND s.rejected IS NULL AND s.at IS NOT NULL AND r.started_at IS NOT NULL"
            " ORDER BY r.round, s.seq",
            (RoundState.CLOSED.value, n),
        ).fetchall()
        out: dict[int, list[tuple[str, float, int | None]]] = {}
        for round_, node, after, steps in rows:
            out.setdefault(int(round_), []).append((str(node), float(after), steps))
        return [out[r] for r in sorted(out)]

    def set_deadline(self, round_: int, deadline: float) -> None:
        """Move open ``round_``'s deadline (a held round gathering, a store outage)."""
        self._change_rounds(
            "UPDATE rounds SET deadline=? WHERE round=? AND state=?",
            (deadline, round_, RoundState.OPEN.value),
        )

    def close_round(
        self,
        round_: int,
        closed_at: float,
        base: str | None,
        signed_manifest: str,
        settled_at: float | None = None,
    ) -> bool:
        """Mark an open round closed; ``False`` (and no change) if it was not open."""
        closed, open_ = RoundState.CLOSED.value, RoundState.OPEN.value
        return self._change_rounds(
            "UPDATE rounds SET state=?, closed_at=?, base_fingerprint=?, signed_manifest=?,"
            " settled_at=? WHERE round=? AND state=?",
            (closed, closed_at, base, signed_manifest, settled_at, round_, open_),
        )

    def adopt_round(
        self, round_: int, started_at: float, closed_at: float, base: str | None, signed: str
    ) -> bool:
        """Mark a round this database has not closed as closed by ``signed``, a manifest the
        store already holds (``coordinator.store.catchup``); ``False`` if it is closed here."""
        closed = RoundState.CLOSED.value
        return self._change_rounds(
            "UPDATE rounds SET state=?, started_at=?, closed_at=?, base_fingerprint=?,"
            " signed_manifest=?, published=1 WHERE round=? AND state!=?",
            (closed, started_at, closed_at, base, signed, round_, closed),
        )

    def unpublished(self) -> list[tuple[int, str]]:
        # published=0 first: the partial index rounds_unpublished (``schema.INDEXES``).
        rows = self._conn.execute(
            "SELECT round, signed_manifest FROM rounds WHERE published=0 AND state=?"
            " ORDER BY round",
            (RoundState.CLOSED.value,),
        ).fetchall()
        return [(int(r[0]), str(r[1])) for r in rows]

    def mark_published(self, round_: int) -> None:
        self._change_rounds("UPDATE rounds SET published=1 WHERE round=?", (round_,))
