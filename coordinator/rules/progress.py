"""The open round's progress in memory: who submitted, and whom it still waits for.

Every submission asks whether the round may close now, and every heartbeat whether its node
has submitted. Reading the round's submissions and working out the waited-for set each time
cost O(N) per request, O(N²) per round. This keeps both: the submitters of the round in progress
(read from the database once per round), and the waited-for members that have not submitted,
worked out again only when the membership changed (``Membership.version``). A submission takes
its node out of that set; the round may close early when the set is empty (the rule of
``rounds.should_close``). A rolled-back transaction makes both be read again.

It also remembers who came *late*: asked to upload or submit to a round after it closed. A
member that stopped submitting is no longer waited for (``rounds.waited_set``), which stops an
insider who heartbeats and never submits from stalling every round. But an honest straggler
that missed two rounds in a row is silent by that rule too, and a round that closes the moment
the others are in leaves it late for good: it starts each round when it has finished being late
for the previous one. So a round whose waited-for members are all in, while an expected member
that came late in one of the last ``silent_rounds`` rounds has not submitted, waits a short
grace (``GRACE_SHARE`` of the round's deadline length) before it closes; each round the
straggler is that much less late, until it is in again. An insider gains little by coming late
on purpose: the grace is a fraction of a round, and the deadline still learns only from valid
arrivals. The memory is per process: after a restart nobody is late until they are again.
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.state.db import Database, RoundRow
from protocol.runconfig import Timing

#: Share of the round's deadline length a round waits, once its waited-for members are in, for
#: a member that came late recently (see the module's docstring).
GRACE_SHARE = 0.25
#: Rounds of late arrivals remembered.
LATE_HISTORY = 16


class RoundProgress:
    """Submitters and missing members of one round at a time, kept up to date incrementally."""

    def __init__(
        self,
        db: Database,
        waited: Callable[[int], set[str]],
        version: Callable[[], int],
        is_expected: Callable[[str, int], bool],
        timing: Timing,
    ) -> None:
        self.db = db
        self._waited = waited
        self._version = version
        self._is_expected = is_expected
        self._silent_rounds = timing.silent_rounds
        #: (round, the node ids with a submission to it)
        self._subs: tuple[int, set[str]] = (-1, set())
        #: ((round, membership version), waited-for members without a submission)
        self._missing: tuple[tuple[int, int], set[str]] = ((-1, -1), set())
        #: round -> members that asked to upload or submit to it after it closed
        self._late: dict[int, set[str]] = {}
        #: (round, when its waited-for members were all in)
        self._settled: tuple[int, float] = (-1, 0.0)
        db.on_rollback.append(self.forget)

    def forget(self) -> None:
        """Drop what is kept; it is read again when next asked for (after a rollback)."""
        self._subs = (-1, set())
        self._missing = ((-1, -1), set())

    def submitted(self, round_: int) -> set[str]:
        """The nodes with a submission (accepted or not) to ``round_``."""
        if self._subs[0] != round_:
            self._subs = (round_, {s.node_id for s in self.db.submissions(round_)})
        return self._subs[1]

    def missing(self, round_: int) -> set[str]:
        """The members ``round_`` waits for that have not submitted yet."""
        key = (round_, self._version())
        if self._missing[0] != key:
            self._missing = (key, self._waited(round_) - self.submitted(round_))
        return self._missing[1]

    def add(self, round_: int, node_id: str) -> None:
        """``node_id``'s submission to ``round_`` was committed."""
        self.submitted(round_).add(node_id)
        self.missing(round_).discard(node_id)

    def note_late(self, round_: int, node_id: str) -> None:
        """``node_id`` asked to upload or submit to ``round_`` after it closed."""
        self._late.setdefault(round_, set()).add(node_id)
        for old in [r for r in self._late if r < round_ - LATE_HISTORY]:
            del self._late[old]

    def late(self, first: int, last: int) -> set[str]:
        """Members that came late to a round in [first, last]."""
        return set().union(*(self._late.get(r, set()) for r in range(first, last + 1)))

    def may_close(self, cur: RoundRow, now: float) -> bool:
        """Whether open round ``cur`` may close before its deadline: every waited-for member
        is in, and every expected member that came late recently and is not in has had its
        grace (``GRACE_SHARE`` of the time from the round's start to its deadline)."""
        round_ = cur.round
        if self.missing(round_):
            return False
        n = self._silent_rounds
        late = self.late(round_ - n, round_ - 1) - self.submitted(round_)
        if not any(self._is_expected(node, round_) for node in late):
            return True
        if self._settled[0] != round_:
            self._settled = (round_, now)
        length = (cur.deadline or now) - (cur.started_at or now)
        return now >= self._settled[1] + GRACE_SHARE * length
