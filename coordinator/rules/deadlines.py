"""When an open round's deadline closes it: held while nothing came and members still work,
widened for the others once the first payload of a held round came, paused while the store is
down.

A run's ``rounds`` are rounds that aggregated something. Three things keep a deadline from
spending one on nothing:

- **hold** (``rounds.is_held``): a round whose deadline passed with no valid submission stays
  open while a member it expects is alive and says (in its heartbeats) that it is training or
  cannot reach the store, or said it was waiting before the round opened (it was waiting for
  the previous round, and has been applying it and training since). Logged once per round
  (``event=round_held``); it ends with the first valid submission, or when no such member is
  left (then the round closes empty, as before);
- **gathering window** (``rounds.gather_window``): when the first valid submission of a held
  round arrives, the round does not close with that one node; its deadline moves to the window's
  end, so members a little behind it are gathered too (``event=round_gathering``). Every member
  the round waits for being in still closes it at once;
- **pause**: while the coordinator itself cannot reach the store (``coordinator.store.storewatch``),
  no deadline closes a round; when the store answers again the open round's deadline moves later by
  the time it lost (``rounds.paused_by``).

Everything here is memory of one process: after a restart a held round is held again by the
next tick, and a store outage is seen again by the next probe.
"""

from __future__ import annotations

import logging

from coordinator.rules import rounds
from coordinator.rules.membership import Membership
from coordinator.state.db import Database, RoundRow
from protocol.messages import RoundState
from protocol.runconfig import Timing

log = logging.getLogger("sparseloco.coordinator.deadlines")


class Deadlines:
    """Decides whether an open round's deadline counts now; moves it when it must."""

    def __init__(self, db: Database, members: Membership, timing: Timing) -> None:
        self.db = db
        self.members = members
        self.timing = timing
        #: Since when the coordinator has seen the store down (``None``: it answers).
        self.paused_since: float | None = None
        #: The round whose hold was last logged (one line per held round).
        self._held_logged = -1

    def has_valid(self, round_: int) -> bool:
        """Whether ``round_`` has a submission not refused on arrival."""
        return any(s.rejected is None for s in self.db.submissions(round_))

    def overdue(self, cur: RoundRow, now: float) -> bool:
        """Whether open round ``cur`` closes on its deadline now (not paused, not held)."""
        if cur.deadline is None or now < cur.deadline or self.paused_since is not None:
            return False
        busy = self.members.busy(cur.round, cur.started_at)
        if not rounds.is_held(self.has_valid(cur.round), busy):
            return True
        if self._held_logged != cur.round:
            self._held_logged = cur.round
            log.info(
                "event=round_held round=%d over_deadline_s=%.1f busy=%s (nothing submitted yet;"
                " waiting for members that are training or cannot reach the store)",
                cur.round,
                now - cur.deadline,
                ",".join(sorted(busy)),
            )
        return False

    def arrived(self, cur: RoundRow, now: float) -> None:
        """A valid submission to open round ``cur`` was recorded: if it is the first one of a
        round held past its deadline, give the others the gathering window."""
        if cur.deadline is None or cur.started_at is None or now < cur.deadline:
            return
        valid = [s for s in self.db.submissions(cur.round) if s.rejected is None]
        if len(valid) != 1:
            return
        spreads = self.db.arrival_spreads(rounds.DEADLINE_HISTORY)
        window = rounds.gather_window(spreads, now - cur.started_at, self.timing)
        with self.db.tx():
            self.db.set_deadline(cur.round, now + window)
        log.info(
            "event=round_gathering round=%d first=%s window_s=%.1f",
            cur.round,
            valid[0].node_id,
            window,
        )

    def pause(self, now: float) -> None:
        """The coordinator cannot reach the store: no deadline closes a round until ``resume``."""
        if self.paused_since is None:
            self.paused_since = now

    def resume(self, cur: RoundRow | None, now: float) -> tuple[int, float] | None:
        """The store answers again: move open round ``cur``'s deadline later by what the outage
        took from it; (round, seconds added), or ``None`` if no round was open."""
        since, self.paused_since = self.paused_since, None
        if since is None or cur is None or cur.state != RoundState.OPEN:
            return None
        if cur.deadline is None or cur.started_at is None:
            return None
        lost = rounds.paused_by(since, cur.started_at, now)
        with self.db.tx():
            self.db.set_deadline(cur.round, cur.deadline + lost)
        return cur.round, lost
