"""What the node is doing, as its heartbeats tell the coordinator (``NodeCondition``).

The coordinator keeps a round nobody has submitted to open past its deadline while a member says
it is ``training`` or ``store_unreachable`` (closing it would aggregate nothing and spend one of
the run's rounds), and lets it close once every member is only ``waiting``. So the node says:

- ``store_unreachable`` while its link to the store is down (``node.daemon.retry.Link``);
- ``waiting`` while it only waits for a round it submitted to to close, and trains nothing
  meanwhile (with overlap it trains while it waits);
- ``training`` otherwise: training, sending, or applying the rounds before its next payload;
- ``observing``, above all of these, while its link cannot get a payload in within a round's
  budget (``node.daemon.budgeting``): it applies every round and no round waits for it.

A change of condition sends a heartbeat soon (``due``), at most one per ``GAP_S``, so the
coordinator does not act on what the node did a heartbeat interval ago.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence

from node.daemon.api import Clock
from node.daemon.retry import Link
from protocol.messages import NodeCondition

#: Shortest pause between two heartbeats sent because the condition changed.
GAP_S = 1.0


class Condition:
    """Idle waits and trainings in progress, and the store's link, as one ``NodeCondition``."""

    def __init__(self, links: Sequence[Link]) -> None:
        self.links = tuple(links)
        self._idle_waits = 0
        self._trainings = 0
        self._observing = False
        self._changed = asyncio.Event()

    def observe(self, on: bool) -> None:
        """The node starts (or stops) only observing: it says so at once."""
        if on != self._observing:
            self._observing = on
            self._changed.set()

    def now(self) -> NodeCondition:
        if self._observing:
            return NodeCondition.OBSERVING
        if any(link.service == "store" and not link.up for link in self.links):
            return NodeCondition.STORE_UNREACHABLE
        if self._idle_waits and not self._trainings:
            return NodeCondition.WAITING
        return NodeCondition.TRAINING

    @contextlib.contextmanager
    def doing(self, *, idle: bool) -> Iterator[None]:
        """Count an idle wait (``idle``) or a training for as long as the block runs."""
        before = self.now()
        self._count(idle, 1)
        try:
            if self.now() != before:
                self._changed.set()
            yield
        finally:
            inside = self.now()
            self._count(idle, -1)
            if self.now() != inside:
                self._changed.set()

    def _count(self, idle: bool, step: int) -> None:
        if idle:
            self._idle_waits += step
        else:
            self._trainings += step

    async def due(self, clock: Clock, interval: float) -> None:
        """Return after ``interval``, or sooner (not within ``GAP_S``) once the condition
        changed, so the coordinator hears of it promptly."""
        gap = min(interval, GAP_S)
        await clock.sleep(gap)
        changed = asyncio.ensure_future(self._changed.wait())
        rest = asyncio.ensure_future(clock.sleep(interval - gap))
        try:
            await asyncio.wait({changed, rest}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (changed, rest):
                task.cancel()
            self._changed.clear()
