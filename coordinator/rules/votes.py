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

Every submission asks for the previous round's majority and every report for the round's
participants, so both are kept in memory for the newest rounds (``CACHED_ROUNDS``): a closed
round's participants never change, and reports are only ever added, so a tally stays right
while no report was written through the database since it was built (``Database.report_writes``,
a counter in memory: a report recorded through another ``Votes`` on the same database, or one
rolled back, makes it rebuild; at 1,000 nodes a count of the rows per submission was most of
the submit's reads). Reports come in over this process's HTTP API only.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from typing import TypeVar

from coordinator.base.errors import Conflict, UnknownRound
from coordinator.rules import rounds
from coordinator.state.db import Database
from protocol.messages import RoundState, SignedManifest
from protocol.reports import RoundReport

log = logging.getLogger("sparseloco.coordinator.machine")

T = TypeVar("T")

#: Closed rounds whose participants and tally stay in memory (the newest are the ones asked for).
CACHED_ROUNDS = 8


class Votes:
    """The reports of one run's closed rounds, counted by participation."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._participants: OrderedDict[int, frozenset[str]] = OrderedDict()
        #: round -> (``db.report_writes`` when it was counted, fingerprint -> participants' votes)
        self._tally: OrderedDict[int, tuple[int, Counter[str]]] = OrderedDict()

    def participants(self, round_: int) -> frozenset[str]:
        """The nodes closed round ``round_``'s manifest names (gathered or excluded); empty
        while the round is not closed."""
        known = self._participants.get(round_)
        if known is not None:
            return known
        row = self.db.get_round(round_)
        if row is None or row.state != RoundState.CLOSED or row.signed_manifest is None:
            return frozenset()
        manifest = SignedManifest.model_validate_json(row.signed_manifest).manifest
        voters = frozenset({e.node_id for e in manifest.gather} | set(manifest.excluded))
        _remember(self._participants, round_, voters)
        return voters

    def tally(self, round_: int) -> Counter[str]:
        """How many of ``round_``'s participants reported each fingerprint."""
        stamp = self.db.report_writes
        cached = self._tally.get(round_)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        voters = self.participants(round_)
        reported = self.db.reported_fingerprints(round_)
        counts = Counter(fp for node, fp in reported.items() if node in voters)
        if voters:  # a round not closed yet has no tally to keep
            _remember(self._tally, round_, (stamp, counts))
        return counts

    def reported(self, round_: int) -> list[str]:
        """The fingerprints ``round_``'s participants reported after applying it."""
        return sorted(self.tally(round_).elements())

    def majority(self, round_: int) -> str | None:
        """The participants' majority fingerprint of θ after ``round_``; ``None`` without votes."""
        return rounds.majority_of(self.tally(round_))

    def record(self, node_id: str, round_: int, report: RoundReport) -> bool:
        """Record ``node_id``'s report of closed ``round_``; True if it is its first for it.

        ``unknown_round`` (404) for a round that does not exist, ``round_open`` while it is not
        closed, ``not_member`` from a node that took no part in it.
        """
        # Participants are kept for closed rounds only: a round among them needs no read.
        state = RoundState.CLOSED if round_ in self._participants else self.db.round_state(round_)
        if state is None:
            raise UnknownRound(round_)
        if state != RoundState.CLOSED:
            raise Conflict("round_open", f"round {round_} is not closed yet; report after it")
        if node_id not in self.participants(round_):
            raise Conflict(
                "not_member", f"{node_id} took no part in round {round_}; it cannot report on it"
            )
        before = self.db.report_writes
        with self.db.tx():
            first = self.db.record_report(
                round_, node_id, report.fingerprint, report.model_dump_json()
            )
        cached = self._tally.get(round_)
        if cached is not None and cached[0] == before:  # nothing else written since: add it
            if first:
                cached[1][report.fingerprint] += 1
            self._tally[round_] = (self.db.report_writes, cached[1])
        log.debug(  # a line per node and round; GET /v1/status lists every node's fingerprint
            "event=reported round=%d node=%s fingerprint=%s", round_, node_id, report.fingerprint
        )
        return first


def _remember(cache: OrderedDict[int, T], round_: int, value: T) -> None:
    """Keep ``value`` for ``round_``, dropping the oldest round beyond ``CACHED_ROUNDS``."""
    cache[round_] = value
    while len(cache) > CACHED_ROUNDS:
        cache.popitem(last=False)
