"""Votes: the nodes' reports of closed rounds, and who may cast them.

After applying round r every node reports the fingerprint of θ_{r+1}. Two decisions rest on the
majority of those reports: the base fingerprint round r+1's payloads must be trained from (a
node on another θ is excluded as "wrong base fingerprint"), and which checkpoint of θ_{r+1} may
be committed. So a report is a vote, and only the nodes that took part in round r cast one: the
nodes its signed manifest names, gathered or excluded (every member while it was open, including
one that left or timed out during it). A token that never joined, or joined after the round, is
refused with ``not_member``; and the majorities count participants' reports only, so a report
recorded before this rule existed does not count either.

Synchronous and free of HTTP, over the coordinator's ``Database``, like the round machine that
uses it (and the checkpoint book, which asks it for the same majority).
"""

from __future__ import annotations

import logging

from coordinator import rounds
from coordinator.db import Database
from coordinator.errors import Conflict, UnknownRound
from protocol.messages import RoundReport, RoundState, SignedManifest

log = logging.getLogger("sparseloco.coordinator.machine")


class Votes:
    """The reports of one run's closed rounds, counted by participation."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def participants(self, round_: int) -> set[str]:
        """The nodes closed round ``round_``'s manifest names (gathered or excluded); empty
        while the round is not closed."""
        row = self.db.get_round(round_)
        if row is None or row.state != RoundState.CLOSED or row.signed_manifest is None:
            return set()
        manifest = SignedManifest.model_validate_json(row.signed_manifest).manifest
        return {e.node_id for e in manifest.gather} | set(manifest.excluded)

    def reported(self, round_: int) -> list[str]:
        """The fingerprints ``round_``'s participants reported after applying it, by node."""
        voters = self.participants(round_)
        return [fp for node, fp in self.db.reported_fingerprints(round_).items() if node in voters]

    def majority(self, round_: int) -> str | None:
        """The participants' majority fingerprint of θ after ``round_``; ``None`` without votes."""
        return rounds.majority(self.reported(round_))

    def record(self, node_id: str, round_: int, report: RoundReport) -> bool:
        """Record ``node_id``'s report of closed ``round_``; True if it is its first for it.

        ``unknown_round`` (404) for a round that does not exist, ``round_open`` while it is not
        closed, ``not_member`` from a node that took no part in it.
        """
        row = self.db.get_round(round_)
        if row is None:
            raise UnknownRound(round_)
        if row.state != RoundState.CLOSED:
            raise Conflict("round_open", f"round {round_} is not closed yet; report after it")
        if node_id not in self.participants(round_):
            raise Conflict(
                "not_member", f"{node_id} took no part in round {round_}; it cannot report on it"
            )
        with self.db.tx():
            first = self.db.record_report(
                round_, node_id, report.fingerprint, report.model_dump_json()
            )
        log.info(
            "event=reported round=%d node=%s fingerprint=%s", round_, node_id, report.fingerprint
        )
        return first
