"""Membership: who takes part in the run, and when each member was last heard from.

A node joins (or rejoins) and becomes ``active``; it stays active while it heartbeats within
``heartbeat_timeout_s``, and becomes ``left`` when it says goodbye, ``timed out`` when it falls
silent, ``revoked`` when the operator revokes its token, and ``finished`` when the run's last
round closes while it is active (or when it joins a finished run): a normal end is not a
timeout. Its slot is fixed at its first join. Which round a joiner starts with is a round rule
(``rounds.joined_round_for``), so the round machine decides it and hands it over.

An active member is bound to the process that joined it (its ``instance``, a random id the node
sends). Another process presenting the same token is refused (``TokenInUse``) while the member
is active and was heard from within the heartbeat timeout; after that timeout, or after a clean
leave, a new process may join and take over. So may, at once, a process that names the bound
one as its predecessor on the same state directory (``previous``: the node restarted after a
crash; only a process with that directory knows the id). A request without an instance id (a
client older than the binding) is not checked.

Kept apart from the round machine because it owns the one piece of state that is not in the
database: the last heartbeat of every active member, and what it said the member was doing
(``NodeCondition``: a round nobody submitted to is held past its deadline while a member is at
work on it, ``coordinator.rules.deadlines``). That is deliberately not persisted: after a
restart every active member gets a fresh window, so nobody times out because the coordinator was
down; a heartbeat is a dictionary write, never a database write. Writes run inside the caller's
transaction when there is one (``Database.tx`` nests).

Every request asks about members (is it expected, which process holds it), so the members table
is mirrored in memory: loaded at start, updated with every write made here (all of them are),
reloaded after a rollback. ``version`` moves with every change, so the round machine knows when
the set a round waits for must be worked out again.
"""

from __future__ import annotations

import dataclasses
import logging

from coordinator.base.errors import Conflict, TokenInUse
from coordinator.rules import rounds
from coordinator.state.db import Database, MemberRow
from protocol.messages import MemberState, NodeCondition

log = logging.getLogger("sparseloco.coordinator.membership")


class Membership:
    """The members table plus each active member's last heartbeat (wall clock)."""

    def __init__(self, db: Database, *, heartbeat_timeout_s: float, now: float) -> None:
        self.db = db
        self.heartbeat_timeout_s = heartbeat_timeout_s
        #: The members table, by node id, in slot order.
        self._rows: dict[str, MemberRow] = {}
        #: How many of them are active (kept with every change: a join asks, O(1)).
        self._active = 0
        #: Moves with every change of a member (the round machine's cache key).
        self.version = 0
        self._load()
        db.on_rollback.append(self._load)
        #: node id -> time of its last heartbeat (or join, or the coordinator's start).
        self.last_seen: dict[str, float] = {
            m.node_id: now for m in self._rows.values() if m.state == MemberState.ACTIVE
        }
        #: node id -> what its last heartbeat said it was doing (``None``: it did not say, an
        #: older node). Until a member's first heartbeat after its join or the coordinator's
        #: start it counts as training: it was busy when last heard of, and a round it has not
        #: submitted to must not close empty in the moment before it says so.
        self.conditions: dict[str, NodeCondition | None] = dict.fromkeys(
            self.last_seen, NodeCondition.TRAINING
        )
        #: node id -> when it said its condition.
        self.said_at: dict[str, float] = dict(self.last_seen)

    def _load(self) -> None:
        """(Re)read the members table: at start, and after a rollback undid a write."""
        self._rows = {m.node_id: m for m in self.db.members()}
        self._active = sum(1 for m in self._rows.values() if m.state == MemberState.ACTIVE)
        self.version += 1

    def _put(self, row: MemberRow) -> None:
        """Replace (or add) ``row`` in memory, keeping the active count."""
        old = self._rows.get(row.node_id)
        was_active = old is not None and old.state == MemberState.ACTIVE
        self._active += (row.state == MemberState.ACTIVE) - was_active
        self._rows[row.node_id] = row

    def _set(self, node_id: str, state: MemberState, joined: int, gone: int | None) -> None:
        self.db.set_member(node_id, state, joined, gone)
        row = self._rows[node_id]
        self._put(dataclasses.replace(row, state=state, joined_round=joined, gone_in_round=gone))
        self.version += 1

    def _end(self, node_id: str, state: MemberState, joined: int, gone: int | None) -> None:
        """``node_id`` takes no more part (left, timed out, revoked, finished): the change in one
        transaction, then its heartbeat, condition and their times forgotten."""
        with self.db.tx():
            self._set(node_id, state, joined, gone)
        self.last_seen.pop(node_id, None)
        self.conditions.pop(node_id, None)
        self.said_at.pop(node_id, None)

    def row(self, node_id: str) -> MemberRow | None:
        """The members row of ``node_id``, from memory."""
        return self._rows.get(node_id)

    def members(self) -> list[rounds.Member]:
        """Every member as the round rules see it, in slot order."""
        return [rule_member(m) for m in self._rows.values()]

    def active_count(self) -> int:
        return self._active

    def is_expected(self, node_id: str, round_: int) -> bool:
        """Whether ``node_id`` is a member that must submit to ``round_``."""
        member = self._rows.get(node_id)
        return member is not None and rounds.is_expected(rule_member(member), round_)

    def check_instance(
        self, node_id: str, instance: str | None, now: float, previous: str | None = None
    ) -> None:
        """Refuse (``TokenInUse``) any process but the one a live, active member is bound to,
        or its successor on the same state directory (``previous`` names the bound one)."""
        if instance is None:
            return
        member = self._rows.get(node_id)
        if member is None or member.state != MemberState.ACTIVE:
            return
        if member.instance is None or instance == member.instance:
            return
        if previous is not None and previous == member.instance:
            log.info("event=took_over node=%s instance=%s previous=%s", node_id, instance, previous)
            return
        remaining = self.last_seen.get(node_id, now) + self.heartbeat_timeout_s - now
        if remaining > 0:
            log.warning(
                "event=token_in_use node=%s instance=%s bound=%s retry_after_s=%.1f",
                node_id,
                instance,
                member.instance,
                remaining,
            )
            raise TokenInUse(node_id, remaining)

    def join(
        self,
        node_id: str,
        client: str,
        *,
        joined: int,
        current: int,
        now: float,
        instance: str | None = None,
        previous: str | None = None,
        finished: bool = False,
    ) -> int:
        """Make ``node_id`` active, taking part from round ``joined``; returns its slot.

        ``current`` is the round in progress: an active member that already takes part in it
        (a retried join) keeps the round it joined in. The member is bound to ``instance``,
        unless another live process holds it (``TokenInUse``; ``previous`` may take over from
        the process it names, see ``check_instance``). In a ``finished`` run the member
        is recorded as finished: there is nothing left to take part in, or to time out of.
        """
        with self.db.tx():
            self.check_instance(node_id, instance, now, previous)
            member = self._rows.get(node_id)
            state = MemberState.FINISHED if finished else MemberState.ACTIVE
            if member is None:
                slot = self.db.add_member(node_id, joined, client)
                self._put(MemberRow(node_id, slot, state, joined, None))
            else:
                slot = member.slot
                if member.state == MemberState.ACTIVE and member.joined_round <= current:
                    joined = member.joined_round
            self._set(node_id, state, joined, None)
            self.db.bind_instance(node_id, instance)
            self._put(dataclasses.replace(self._rows[node_id], instance=instance))
            if not finished:
                self.last_seen[node_id] = now
                self.conditions[node_id] = NodeCondition.TRAINING
                self.said_at[node_id] = now
        log.info(
            "event=joined node=%s slot=%d joined_round=%d round=%d returning=%s instance=%s%s",
            node_id,
            slot,
            joined,
            current,
            member is not None,
            instance or "-",
            " run_finished=true" if finished else "",
        )
        return slot

    def heartbeat(self, node_id: str, now: float, condition: NodeCondition | None = None) -> None:
        """Note that ``node_id`` is alive and what it is doing; ``not_member`` unless it is an
        active member.

        A finished member may still beat (it may be replaying the last rounds); nothing changes.
        """
        member = self._rows.get(node_id)
        if member is not None and member.state == MemberState.FINISHED:
            return
        if member is None or member.state != MemberState.ACTIVE:
            raise Conflict("not_member", f"{node_id} is not an active member; join again")
        self._say(node_id, now, condition)

    def _say(self, node_id: str, now: float, condition: NodeCondition | None) -> None:
        """``node_id`` was heard from now, doing ``condition``. Starting or ending to only
        observe changes whom a round waits for, so that moves the version."""
        was = self.conditions.get(node_id)
        self.last_seen[node_id] = now
        self.conditions[node_id] = condition
        self.said_at[node_id] = now
        if (was == NodeCondition.OBSERVING) != (condition == NodeCondition.OBSERVING):
            self.version += 1

    def observing(self) -> set[str]:
        """Active members whose last word was that they only observe (``OBSERVING``)."""
        return {n for n, c in self.conditions.items() if c == NodeCondition.OBSERVING}

    def heard(self, node_id: str, now: float, condition: NodeCondition) -> bool:
        """A request of ``node_id`` said ``condition``: a heartbeat if it is an active member
        (whether it was one). Unlike ``heartbeat`` a non-member is no error: the request it came
        with (a dataset read before joining, say) decides what it may do."""
        member = self._rows.get(node_id)
        if member is None or member.state != MemberState.ACTIVE:
            return False
        self._say(node_id, now, condition)
        return True

    def busy(self, round_: int, opened_at: float | None = None) -> list[str]:
        """The members expected in ``round_`` (opened at ``opened_at``) that are alive (active,
        heard from within the timeout) and at work on it (``rounds.is_busy``)."""
        return [
            m.node_id
            for m in self._rows.values()
            if rounds.is_expected(rule_member(m), round_)
            and m.node_id in self.last_seen
            and rounds.is_busy(
                self.conditions.get(m.node_id), self.said_at.get(m.node_id, 0.0), opened_at
            )
        ]

    def leave(self, node_id: str, current: int) -> None:
        """Mark ``node_id`` as left during round ``current``; ``not_member`` if it never joined.

        A finished member stays finished: leaving after the end is the normal way out.
        """
        member = self._rows.get(node_id)
        if member is None:
            raise Conflict("not_member", f"{node_id} never joined")
        if member.state == MemberState.FINISHED:
            return
        self._end(node_id, MemberState.LEFT, member.joined_round, current)
        log.info("event=left node=%s round=%d", node_id, current)

    def time_out(self, current: int, now: float) -> None:
        """Mark every active member silent for longer than the timeout as timed out."""
        limit = now - self.heartbeat_timeout_s
        for member in list(self._rows.values()):
            if member.state != MemberState.ACTIVE:
                continue
            seen = self.last_seen.setdefault(member.node_id, now)
            if seen >= limit:
                continue
            self._end(member.node_id, MemberState.TIMED_OUT, member.joined_round, current)
            log.warning(
                "event=timed_out node=%s round=%d silent_s=%.1f",
                member.node_id,
                current,
                now - seen,
            )

    def revoke(self, node_id: str, current: int) -> bool:
        """The node's token was revoked: it takes no further part; whether anything changed.

        An active member counts as gone in round ``current`` (so that round no longer waits for
        it); a member that already left or timed out keeps the round it went in.
        """
        member = self._rows.get(node_id)
        if member is None or member.state in (MemberState.REVOKED, MemberState.FINISHED):
            return False
        gone = current if member.state == MemberState.ACTIVE else member.gone_in_round
        self._end(node_id, MemberState.REVOKED, member.joined_round, gone)
        log.warning("event=revoked node=%s round=%d was=%s", node_id, current, member.state)
        return True

    def finish(self, last_round: int) -> int:
        """The run's last round closed: every active member finished; how many."""
        finished = 0
        for member in list(self._rows.values()):
            if member.state != MemberState.ACTIVE:
                continue
            self._end(member.node_id, MemberState.FINISHED, member.joined_round, last_round)
            finished += 1
        return finished


def rule_member(row: MemberRow) -> rounds.Member:
    """A members row as the pure round rules take it."""
    return rounds.Member(row.node_id, row.state, row.joined_round, row.gone_in_round)
