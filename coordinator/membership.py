"""Membership: who takes part in the run, and when each member was last heard from.

A node joins (or rejoins) and becomes ``active``; it stays active while it heartbeats within
``heartbeat_timeout_s``, and becomes ``left`` when it says goodbye or ``timed_out`` when it falls
silent. Its slot is fixed at its first join. Which round a joiner starts with is a round rule
(``rounds.joined_round_for``), so the round machine decides it and hands it over.

Kept apart from the round machine because it owns the one piece of state that is not in the
database: the last heartbeat of every active member. That is deliberately not persisted: after a
restart every active member gets a fresh window, so nobody times out because the coordinator was
down. Writes run inside the caller's transaction when there is one (``Database.tx`` nests).
"""

from __future__ import annotations

import logging

from coordinator import rounds
from coordinator.db import Database, MemberRow
from coordinator.errors import Conflict
from protocol.messages import MemberState

log = logging.getLogger("sparseloco.coordinator.membership")


class Membership:
    """The members table plus each active member's last heartbeat (wall clock)."""

    def __init__(self, db: Database, *, heartbeat_timeout_s: float, now: float) -> None:
        self.db = db
        self.heartbeat_timeout_s = heartbeat_timeout_s
        #: node id -> time of its last heartbeat (or join, or the coordinator's start).
        self.last_seen: dict[str, float] = {
            m.node_id: now for m in db.members() if m.state == MemberState.ACTIVE
        }

    def members(self) -> list[rounds.Member]:
        """Every member as the round rules see it, in slot order."""
        return [rule_member(m) for m in self.db.members()]

    def active_count(self) -> int:
        return sum(1 for m in self.db.members() if m.state == MemberState.ACTIVE)

    def is_expected(self, node_id: str, round_: int) -> bool:
        """Whether ``node_id`` is a member that must submit to ``round_``."""
        member = self.db.member(node_id)
        return member is not None and rounds.is_expected(rule_member(member), round_)

    def join(self, node_id: str, client: str, *, joined: int, current: int, now: float) -> int:
        """Make ``node_id`` active, taking part from round ``joined``; returns its slot.

        ``current`` is the round in progress: an active member that already takes part in it
        (a retried join) keeps the round it joined in.
        """
        with self.db.tx():
            member = self.db.member(node_id)
            if member is None:
                slot = self.db.add_member(node_id, joined, client)
            else:
                slot = member.slot
                if member.state == MemberState.ACTIVE and member.joined_round <= current:
                    joined = member.joined_round
                self.db.set_member(node_id, MemberState.ACTIVE, joined, None)
            self.last_seen[node_id] = now
        log.info(
            "event=joined node=%s slot=%d joined_round=%d round=%d returning=%s",
            node_id,
            slot,
            joined,
            current,
            member is not None,
        )
        return slot

    def heartbeat(self, node_id: str, now: float) -> None:
        """Note that ``node_id`` is alive; ``not_member`` unless it is an active member."""
        member = self.db.member(node_id)
        if member is None or member.state != MemberState.ACTIVE:
            raise Conflict("not_member", f"{node_id} is not an active member; join again")
        self.last_seen[node_id] = now

    def leave(self, node_id: str, current: int) -> None:
        """Mark ``node_id`` as left during round ``current``; ``not_member`` if it never joined."""
        member = self.db.member(node_id)
        if member is None:
            raise Conflict("not_member", f"{node_id} never joined")
        with self.db.tx():
            self.db.set_member(node_id, MemberState.LEFT, member.joined_round, current)
        self.last_seen.pop(node_id, None)
        log.info("event=left node=%s round=%d", node_id, current)

    def time_out(self, current: int, now: float) -> None:
        """Mark every active member silent for longer than the timeout as timed out."""
        limit = now - self.heartbeat_timeout_s
        for member in self.db.members():
            if member.state != MemberState.ACTIVE:
                continue
            seen = self.last_seen.setdefault(member.node_id, now)
            if seen >= limit:
                continue
            with self.db.tx():
                self.db.set_member(
                    member.node_id, MemberState.TIMED_OUT, member.joined_round, current
                )
            self.last_seen.pop(member.node_id, None)
            log.warning(
                "event=timed_out node=%s round=%d silent_s=%.1f",
                member.node_id,
                current,
                now - seen,
            )


def rule_member(row: MemberRow) -> rounds.Member:
    """A members row as the pure round rules take it."""
    return rounds.Member(row.node_id, row.state, row.joined_round, row.gone_in_round)
