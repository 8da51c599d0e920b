"""Bandwidth caps: a node may limit how fast it uploads and downloads.

A participant on a shared or metered link does not want its node to take the whole line, and
the benchmarks use the same caps to shape links on a kernel without ``netem``. Each direction
has one token bucket (``Bandwidth``) shared by every transfer of the node in that direction, so
eight parallel downloads together stay under the download cap. Bytes are taken from the bucket
in chunks of at most ``CHUNK`` as they are sent or read; the bucket holds at most
``BURST_S`` seconds of traffic, so an idle link does not bank an unbounded burst.

Rates are given as people write them (``parse_rate``): ``100Mbit`` (per second, decimal units,
as links are sold), ``12.5MB``, ``800kbit``, ``1Gbit``, or a plain number of bytes per second.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

from protocol.errors import ConfigError

#: Largest piece of a transfer that takes tokens at once.
CHUNK = 64 << 10
#: Seconds of traffic the bucket may hold (the largest burst after an idle spell).
BURST_S = 0.25

_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|b)?(?:/s|ps)?\s*$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: str) -> float:
    """Bytes per second from ``100Mbit``, ``12.5MB``, ``2000000`` and the like; ``ConfigError``
    for anything else, or for a rate that is not positive."""
    m = _RATE.match(text)
    if m is None:
        raise ConfigError(
            f"bandwidth {text!r}: expected a rate such as 100Mbit, 12.5MB or 2000000 (bytes/s)"
        )
    value = float(m[1]) * _SCALE[m[2].lower()]
    if (m[3] or "").lower() == "bit":
        value /= 8
    if value <= 0:
        raise ConfigError(f"bandwidth {text!r}: must be more than 0")
    return value


class Bandwidth:
    """A token bucket of ``rate`` bytes per second, shared by the transfers it is given to."""

    def __init__(
        self,
        rate: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        # Never more than BURST_S of traffic, however slow the link: a bucket of one CHUNK on a
        # 80 kbit/s cap would let a 60 KB payload through unthrottled.
        self.capacity = rate * BURST_S
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.capacity
        self._stamp = clock()
        self._lock = asyncio.Lock()

    def seconds_for(self, size: int) -> float:
        """How long ``size`` bytes take at this rate (for timeouts)."""
        return size / self.rate

    async def take(self, n: int) -> None:
        """Wait until ``n`` bytes may go.

        The bucket may go into debt by one request: the caller then sleeps until the debt is
        paid, holding the lock, so callers queue in arrival order and one large transfer cannot
        starve the others beyond one chunk."""
        async with self._lock:
            now = self._clock()
            self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            if self._tokens < 0:
                await self._sleep(-self._tokens / self.rate)

    async def chunks(self, data: bytes) -> AsyncIterator[bytes]:
        """``data`` in pieces, each let through at the bucket's pace (an upload's body)."""
        view = memoryview(data)
        step = max(1, min(CHUNK, int(self.capacity)))
        for start in range(0, len(view), step):
            piece = view[start : start + step]
            await self.take(len(piece))
            yield bytes(piece)


class Capped(Protocol):
    """What ``Limits.of`` reads (the node's settings)."""

    @property
    def upload_limit(self) -> float | None: ...

    @property
    def download_limit(self) -> float | None: ...


class Limits:
    """The node's caps, one bucket per direction (``None``: that direction is not capped)."""

    def __init__(self, upload: float | None = None, download: float | None = None) -> None:
        self.upload = None if upload is None else Bandwidth(upload)
        self.download = None if download is None else Bandwidth(download)

    @classmethod
    def of(cls, settings: Capped) -> Limits:
        return cls(settings.upload_limit, settings.download_limit)
