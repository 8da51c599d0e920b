"""One service as seen by its client, up or down: one log line when it stops answering, one
when it is back (``Link``).

Every retry of a call to the coordinator or the object store reports its outcome to the
service's link; an outage of any length then reads as two lines in the log, with its cause in
a few words (``protocol.causes``), however many attempts it cost. The node keeps one link per
service (``node.daemon.retry``), the coordinator one for its store (``coordinator.store.storage``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from protocol.causes import cause

log = logging.getLogger("sparseloco.link")

#: Error codes of an answer that blames the service behind the one asked (``Link.behind``).
BEHIND_ERRORS = frozenset({"storage_unavailable"})
#: Longest ``what`` in a line; an object key keeps its end (the round, the file).
MAX_WHAT = 48
#: Seconds between the reminders that a service was never reached at all (a mistyped address
#: looks like an outage; an outage of a service that answered before gets no reminder).
NEVER_REACHED_EVERY_S = 60.0


class Link:
    """How one service (the coordinator, the object store) looks from its client: up or down.

    Retries report every transient failure and every success here; the link logs one WARNING
    when the service stops answering (what was being done, the cause in a few words, since when,
    when the next try is) and one INFO line when it answers again (how long it was gone, how many
    attempts failed), never a line per attempt: those, with the exception's repr, go to DEBUG.
    ``failures`` counts every failed attempt since the start (a node reports it with each round).

    ``behind``: the service this one reaches for us (the coordinator's object store). An answer
    of this service saying that one failed (503 ``storage_unavailable``) is this service
    answering and that one not: it is counted, and logged, against ``behind``.

    A service that has never answered since the start (a mistyped address, a port typo) is not
    an outage to wait out quietly: every ``NEVER_REACHED_EVERY_S`` the link says again that it
    was never reached, where, and ``hint`` (what to check).
    """

    def __init__(
        self,
        service: str,
        *,
        where: str = "",
        hint: str = "",
        logger: logging.Logger | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.service = service
        self.where = where
        self.hint = hint
        self.ever_answered = False
        self._reminded_at = 0.0
        self.log = logger or log
        self.down_since: float | None = None
        self.failed_attempts = 0
        self.failures = 0
        self._monotonic = monotonic
        self._wall = wall
        self._down_at = ""
        self.behind: Link | None = None

    @property
    def up(self) -> bool:
        return self.down_since is None

    def failed(self, what: str, exc: BaseException, retry_in_s: float | None = None) -> None:
        """An attempt at ``what`` failed with ``exc``; the next try is in ``retry_in_s`` (None:
        the operation gave up, whoever called it tries again later)."""
        if self.behind is not None and getattr(exc, "error", None) in BEHIND_ERRORS:
            self.answered()
            self.behind.failed(f"{what} (via the {self.service})", exc, retry_in_s)
            return
        self.failures += 1
        self.failed_attempts += 1
        self.log.debug("event=retry service=%s what=%r error=%r", self.service, what, exc)
        if self.down_since is not None:
            self._remind(exc)
            return
        self.down_since = self._monotonic()
        self._down_at = time.strftime("%H:%M:%S", time.localtime(self._wall()))
        nxt = "later" if retry_in_s is None else f"in_s={retry_in_s:.1f}"
        self.log.warning(
            "event=unreachable service=%s since=%s what=%r cause=%r next_try_%s",
            self.service,
            self._down_at,
            what if len(what) <= MAX_WHAT else "..." + what[3 - MAX_WHAT :],
            cause(exc),
            nxt,
        )

    def _remind(self, exc: BaseException) -> None:
        """Say again, at most every ``NEVER_REACHED_EVERY_S``, that the service never answered."""
        assert self.down_since is not None
        now = self._monotonic()
        if self.ever_answered or now - max(self.down_since, self._reminded_at) < (
            NEVER_REACHED_EVERY_S
        ):
            return
        self._reminded_at = now
        self.log.warning(
            "event=never_reached service=%s at=%s down_s=%.0f failed_attempts=%d cause=%r hint=%r",
            self.service,
            self.where or "-",
            now - self.down_since,
            self.failed_attempts,
            cause(exc),
            self.hint or "-",
        )

    def answered(self) -> None:
        self.ever_answered = True
        if self.down_since is None:
            return
        self.log.info(
            "event=reachable service=%s down_since=%s down_s=%.1f failed_attempts=%d",
            self.service,
            self._down_at,
            self._monotonic() - self.down_since,
            self.failed_attempts,
        )
        self.down_since = None
        self.failed_attempts = 0
