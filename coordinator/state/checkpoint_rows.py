"""The coordinator database's checkpoint tables: upload grants and committed checkpoints.

A part of ``coordinator.state.db.Database`` (which inherits it), kept in a module of its own so each
reads in one place: who may upload the checkpoint of a round until when, and every checkpoint
the coordinator verified, with whether its sidecar is published and whether retention pruned it.
"""

from __future__ import annotations

import sqlite3

from coordinator.state.rows import CheckpointRow, GrantRow
from protocol.messages import CheckpointInfo, CheckpointUpload


class CheckpointTables:
    """Reads and writes of ``checkpoint_grants`` and ``checkpoints`` (on ``Database``)."""

    _conn: sqlite3.Connection

    def grant(self, round_: int) -> GrantRow | None:
        row = self._conn.execute(
            "SELECT node_id, body, expires_at FROM checkpoint_grants WHERE round=?", (round_,)
        ).fetchone()
        if row is None:
            return None
        return GrantRow(round_, row[0], CheckpointUpload.model_validate_json(row[1]), row[2])

    def drop_grant(self, round_: int) -> None:
        """Forget the upload grant of ``round_`` (its file failed verification)."""
        self._conn.execute("DELETE FROM checkpoint_grants WHERE round=?", (round_,))

    def put_grant(
        self, round_: int, node_id: str, body: CheckpointUpload, expires_at: float
    ) -> None:
        self._conn.execute(
            "INSERT OR REPLACE INTO checkpoint_grants(round, node_id, body, expires_at)"
            " VALUES(?,?,?,?)",
            (round_, node_id, body.model_dump_json(), expires_at),
        )

    def add_checkpoint(self, info: CheckpointInfo) -> None:
        """Record a checkpoint whose file the coordinator verified."""
        self._conn.execute(
            "INSERT INTO checkpoints(round, info, verified) VALUES(?, ?, 1)",
            (info.round, info.model_dump_json()),
        )

    def checkpoints(self) -> list[CheckpointRow]:
        """Every committed checkpoint, newest first."""
        rows = self._conn.execute(
            "SELECT info, published, pruned, verified FROM checkpoints ORDER BY round DESC"
        )
        return [
            CheckpointRow(
                CheckpointInfo.model_validate_json(r[0]), bool(r[1]), bool(r[2]), bool(r[3])
            )
            for r in rows
        ]

    def checkpoint(self, round_: int) -> CheckpointInfo | None:
        row = self._conn.execute("SELECT info FROM checkpoints WHERE round=?", (round_,)).fetchone()
        return None if row is None else CheckpointInfo.model_validate_json(row[0])

    def newest_checkpoint(self) -> CheckpointInfo | None:
        row = self._conn.execute(
            "SELECT info FROM checkpoints ORDER BY round DESC LIMIT 1"
        ).fetchone()
        return None if row is None else CheckpointInfo.model_validate_json(row[0])

    def mark_checkpoint(
        self, round_: int, *, published: bool = False, pruned: bool = False
    ) -> None:
        """Set the ``published`` and/or ``pruned`` flag of a committed checkpoint."""
        if published:
            self._conn.execute("UPDATE checkpoints SET published=1 WHERE round=?", (round_,))
        if pruned:
            self._conn.execute("UPDATE checkpoints SET pruned=1 WHERE round=?", (round_,))
