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
from protocol.causes import cause
from protocol.links import BEHIND_ERRORS, Link

__all__ = ["BEHIND_ERRORS", "FOREVER", "TRANSIENT", "Backoff", "Link", "RetryPolicy", "retry"]

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

    ``link`` (if given) hears of every failure and success, and logs the changes of state
    (``protocol.links.Link``).
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
            give_up = attempt >= policy.attempts or elapsed + pause > policy.budget_s
            if link is not None:
                link.failed(what, exc, None if give_up else pause)
            else:
                log.debug("event=retry what=%r attempt=%d error=%r", what, attempt, exc)
            if give_up:
                raise RetriesExhausted(
                    f"{what}: gave up after {attempt} attempts in {elapsed:.1f} s: {cause(exc)}"
                ) from exc
            if link is None:
                log.info(
                    "event=retry what=%r attempt=%d delay_s=%.2f cause=%r",
                    what,
                    attempt,
                    pause,
                    cause(exc),
                )
            await asyncio.sleep(pause)
        else:
            if link is not None:
                link.answered()
            return result
