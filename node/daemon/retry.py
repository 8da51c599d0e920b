"""Bounded retries with exponential backoff and full jitter, for errors named as transient.

Every network call of the node goes through ``retry``: a connection refused while the coordinator
restarts, a 503 from a throttled object store or a read timeout costs a few attempts, not the
round. Anything not classified as transient (a 4xx, a bad digest) fails at once. Each attempt
has its own named timeout set by the caller; ``RetryPolicy.budget_s`` bounds the whole operation.
A ``RetriesExhausted`` from a nested retry passes through at once: the budgets never multiply.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp

from node.errors import RetriesExhausted, TransientError

log = logging.getLogger("sparseloco.retry")

T = TypeVar("T")


#: Library errors that mean "try again": connection problems and timeouts, never bad input.
TRANSIENT: tuple[type[BaseException], ...] = (
    TransientError,
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    asyncio.TimeoutError,
    ConnectionError,
)

#: HTTP statuses that a retry may fix.
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """At most ``attempts`` tries within ``budget_s`` seconds; delays double from ``base_s`` up
    to ``max_delay_s``. ``FOREVER`` never gives up: an outage of any length is waited out."""

    attempts: float = 6
    base_s: float = 0.25
    max_delay_s: float = 8.0
    budget_s: float = 120.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max_delay, base * 2**attempt)]."""
        return rng.uniform(0.0, min(self.max_delay_s, self.base_s * 2.0 ** min(attempt, 60)))


#: Keep trying, pausing at most 10 s between attempts, for as long as it takes.
FOREVER = RetryPolicy(attempts=math.inf, base_s=0.5, max_delay_s=10.0, budget_s=math.inf)


class Link:
    """How one service (the coordinator, the object store) looks from this node: up or down.

    Retries report every transient failure and every success here; the link logs once when the
    service stops answering (WARNING, with the first error) and once when it answers again (with
    how long it was gone and how many attempts failed), never once per attempt. ``failures``
    counts every failed attempt since the node started (reported with each round).
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self.down_since: float | None = None
        self.failed_attempts = 0
        self.failures = 0

    @property
    def up(self) -> bool:
        return self.down_since is None

    def failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        self.failed_attempts += 1
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning(
                "event=unreachable service=%s what=%r error=%r (retrying until it answers)",
                self.service,
                what,
                exc,
            )
        else:
            log.debug("event=retry service=%s what=%r error=%r", self.service, what, exc)

    def answered(self) -> None:
        if self.down_since is not None:
            log.warning(
                "event=reachable service=%s after_s=%.1f failed_attempts=%d",
                self.service,
                time.monotonic() - self.down_since,
                self.failed_attempts,
            )
            self.down_since = None
            self.failed_attempts = 0


_rng = random.Random()


class Backoff:
    """Pauses between repeats of a whole operation (a new grant, fresh URLs) while a service is
    down: doubling from ``first_s`` to ``cap_s``, with jitter so a fleet does not retry in step."""

    def __init__(self, first_s: float = 1.0, cap_s: float = 15.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.current_s = first_s

    def next(self) -> float:
        delay = self.current_s
        self.current_s = min(self.cap_s, self.current_s * 2)
        return delay * _rng.uniform(0.5, 1.0)


async def retry(
    op: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    what: str,
    transient: tuple[type[BaseException], ...] = TRANSIENT,
    link: Link | None = None,
) -> T:
    """Run ``op`` until it succeeds, retrying only ``transient`` errors within ``policy``.

    ``link`` (if given) hears of every failure and success, and logs the changes of state.
    """
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            result = await op()
        except RetriesExhausted:
            raise  # an inner retry already spent its budget: never multiply the attempts
        except transient as exc:
            attempt += 1
            elapsed = time.monotonic() - start
            pause = policy.delay(attempt, _rng)
            if link is not None:
                link.failed(what, exc)
            if attempt >= policy.attempts or elapsed + pause > policy.budget_s:
                raise RetriesExhausted(
                    f"{what}: gave up after {attempt} attempts in {elapsed:.1f} s: {exc!r}"
                ) from exc
            if link is None:
                log.info(
                    "event=retry what=%r attempt=%d delay_s=%.2f error=%r",
                    what,
                    attempt,
                    pause,
                    exc,
                )
            await asyncio.sleep(pause)
        else:
            if link is not None:
                link.answered()
            return result
