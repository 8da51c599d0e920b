"""What every transfer of the node is given, in one value: ``TransferOptions``.

Each PUT, GET, ranged part and upload part of ``node.daemon.transfer``, ``node.daemon.ranged`` and
``node.daemon.multipart`` runs under the same few things: the per-attempt ``TransferTimeouts``,
the ``RetryPolicy``, the ``Link`` told whether the store answers, the ``Bandwidth`` cap of its
direction (if any) and the ``TransferCounts`` that tally what had to be repeated. They always
travel together, so they travel as one frozen value; ``HttpTransfers`` holds one per direction.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from node.daemon.ratelimit import Bandwidth
from node.daemon.retry import Link, RetryPolicy


@dataclass(frozen=True)
class TransferTimeouts:
    """Per-attempt limits, named by phase."""

    connect_s: float = 10.0
    #: Whole PUT or GET of one object or part, including the body.
    transfer_s: float = 120.0

    def client_timeout(
        self, size: int = 0, limit: Bandwidth | None = None
    ) -> aiohttp.ClientTimeout:
        """The limits of one attempt; a capped transfer gets the time its cap needs on top."""
        total = self.transfer_s + (0.0 if limit is None else limit.seconds_for(size))
        return aiohttp.ClientTimeout(total=total, sock_connect=self.connect_s)


DEFAULT_TIMEOUTS = TransferTimeouts()
DEFAULT_POLICY = RetryPolicy()


@dataclass
class TransferCounts:
    """What the transfers of one node had to repeat: ranges resumed after a cut body (and the
    bytes they did not fetch again), upload parts sent again."""

    resumed_ranges: int = 0
    bytes_kept: int = 0
    retried_parts: int = 0


@dataclass(frozen=True)
class TransferOptions:
    """How every attempt of a transfer goes: limited by ``timeouts``, retried under ``policy``
    (``link`` told of each outcome), sent or read at ``bandwidth``'s pace when there is one,
    resumed ranges and resent parts tallied in ``counts`` when there is one."""

    timeouts: TransferTimeouts = DEFAULT_TIMEOUTS
    policy: RetryPolicy = DEFAULT_POLICY
    link: Link | None = None
    bandwidth: Bandwidth | None = None
    counts: TransferCounts | None = None

    def timeout(self, size: int) -> aiohttp.ClientTimeout:
        """The limits of one attempt that moves ``size`` bytes (more time under a cap)."""
        return self.timeouts.client_timeout(size, self.bandwidth)


DEFAULT_OPTIONS = TransferOptions()
