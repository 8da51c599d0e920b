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
    """At most ``attempts`` tries within ``budget_s`` seconds; delays double from ``base_s``."""

    attempts: int = 6
    base_s: float = 0.25
    max_delay_s: float = 8.0
    budget_s: float = 120.0

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max_delay, base * 2**attempt)]."""
        return rng.uniform(0.0, min(self.max_delay_s, self.base_s * 2.0**attempt))


_rng = random.Random()


async def retry(
    op: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy,
    what: str,
    transient: tuple[type[BaseException], ...] = TRANSIENT,
) -> T:
    """Run ``op`` until it succeeds, retrying only ``transient`` errors within ``policy``."""
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return await op()
        except RetriesExhausted:
            raise  # an inner retry already spent its budget: never multiply the attempts
        except transient as exc:
            attempt += 1
            elapsed = time.monotonic() - start
            pause = policy.delay(attempt, _rng)
            if attempt >= policy.attempts or elapsed + pause > policy.budget_s:
                raise RetriesExhausted(
                    f"{what}: gave up after {attempt} attempts in {elapsed:.1f} s: {exc!r}"
                ) from exc
            log.info(
                "event=retry what=%r attempt=%d delay_s=%.2f error=%r", what, attempt, pause, exc
            )
            await asyncio.sleep(pause)
