"""Limits on what one client can make the coordinator do: rates, and how long a request may take.

The coordinator faces the internet, so no client may cost it more than its share. The limits,
each with its reason (``[limits]`` in the config; the defaults are far above what the protocol
needs, which is a few requests per round and a heartbeat every few seconds per node):

====================  ========  ================================================================
key                   default   what it bounds
====================  ========  ================================================================
auth_failures_burst   30        failed authentications (no, unknown or revoked token) one client
auth_failures_per_s   1.0       address may make at once, and their refill rate. Beyond them the
                                address gets 429 ``rate_limited`` with ``Retry-After`` for every
                                request that needs a token, before any token is looked at, so
                                guessing tokens is slowed to the refill rate. Logged once per
                                address per minute. A valid token never spends the allowance, but
                                a node that shares an address with a guesser (behind one NAT or
                                reverse proxy: the address is the TCP peer's) waits with it.
node_requests_burst   600       authenticated requests one node may make at once, and their
node_requests_per_s   50.0      refill rate; beyond them 429 ``rate_limited`` (the node's client
                                retries 429 with backoff). Catching up replays ~2 requests per
                                missed round, which the burst absorbs.
body_timeout_s        30.0      time to receive a request's body once its head arrived: 408
                                ``timeout``; the body's size is bounded by ``max_body_bytes``.
idle_timeout_s        60.0      aiohttp's ``keepalive_timeout``: a connection is closed when no
                                complete request head (line and headers) arrived within this time
                                of its opening or of the previous response. So it bounds both idle
                                keep-alive connections and a client that sends its head slowly
                                (aiohttp has no separate header timeout; its timer is not reset by
                                partial data). Long-polls are not affected: the timer runs only
                                while no request is being handled.
max_tracked_clients   10000     addresses and nodes whose buckets are kept (least recently seen
                                go first), so the limiter's memory is bounded.
====================  ========  ================================================================

aiohttp's own fixed limits apply besides: a request line and each header field of at most
8190 bytes and at most 128 headers (``HEAD_LIMITS``, answered 400), and unread body bytes drained
for at most 10 s after a response (``lingering_time``). Unauthenticated reads (``/v1/status``,
``/metrics``, ``/openapi.json``, the dashboard) are not rate limited: they only read, and the
status is bounded by its ``rounds`` parameter.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from coordinator.base.errors import RateLimited
from protocol.bounds import Count, Positive

log = logging.getLogger("sparseloco.coordinator.limits")

#: aiohttp's limits on a request head, passed explicitly so they are visible and tested.
HEAD_LIMITS: dict[str, int] = {"max_line_size": 8190, "max_field_size": 8190, "max_headers": 128}
#: Seconds unread body bytes are drained after a response before the connection is closed.
LINGERING_S = 10.0
#: A refused client is logged at most once per this many seconds.
LOG_EVERY_S = 60.0


class LimitsConfig(BaseModel):
    """The ``[limits]`` section: rates and timeouts per client (see the module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    auth_failures_burst: Count = 30
    auth_failures_per_s: Positive = 1.0
    node_requests_burst: Count = 600
    node_requests_per_s: Positive = 50.0
    body_timeout_s: Positive = 30.0
    idle_timeout_s: Positive = 60.0
    max_tracked_clients: Count = 10000


def server_settings(config: LimitsConfig) -> dict[str, Any]:
    """The keyword arguments of ``web.AppRunner`` (and aiohttp's ``TestServer``) that apply
    these limits to every connection."""
    timeouts = {"keepalive_timeout": config.idle_timeout_s, "lingering_time": LINGERING_S}
    return {**timeouts, **HEAD_LIMITS}


@dataclass
class _Bucket:
    tokens: float
    at: float


class TokenBuckets:
    """One token bucket per key (an address, a node id): ``burst`` tokens, refilled at ``rate``
    per second; at most ``max_keys`` buckets, the least recently used dropped first."""

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        max_keys: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_keys = max_keys
        self.clock = clock
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def _bucket(self, key: str) -> _Bucket:
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            while len(self._buckets) >= self.max_keys:
                self._buckets.popitem(last=False)
            bucket = self._buckets[key] = _Bucket(self.burst, now)
        else:
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
            self._buckets.move_to_end(key)
        return bucket

    def wait_s(self, key: str) -> float:
        """Seconds until ``key`` has a token (0 if it has one now); takes nothing."""
        bucket = self._bucket(key)
        return 0.0 if bucket.tokens >= 1 else (1 - bucket.tokens) / self.rate

    def take(self, key: str) -> float:
        """Take a token of ``key``: 0 if there was one, else the seconds until there is one
        (and nothing is taken)."""
        wait = self.wait_s(key)
        if not wait:
            self._buckets[key].tokens -= 1
        return wait


class Limits:
    """The rate limits of one coordinator: failed authentications per address, requests per
    node; refusals are raised as ``RateLimited`` (429) and logged once a minute per client."""

    def __init__(self, config: LimitsConfig, *, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        keys = config.max_tracked_clients
        self.auth = TokenBuckets(
            config.auth_failures_per_s, config.auth_failures_burst, max_keys=keys, clock=clock
        )
        self.nodes = TokenBuckets(
            config.node_requests_per_s, config.node_requests_burst, max_keys=keys, clock=clock
        )
        #: (kind, client) -> [when last logged, refusals since]
        self._refused: OrderedDict[tuple[str, str], list[float]] = OrderedDict()

    def before_auth(self, address: str) -> None:
        """Refuse a request that needs a token from an address out of failed attempts."""
        wait = self.auth.wait_s(address)
        if wait:
            self._refuse("auth", address, wait, "too many failed authentications from here")

    def auth_failed(self, address: str) -> None:
        """A request from ``address`` presented no valid token."""
        self.auth.take(address)

    def node_request(self, node_id: str) -> None:
        """Count one authenticated request of ``node_id``; ``RateLimited`` over its rate."""
        wait = self.nodes.take(node_id)
        if wait:
            self._refuse("node", node_id, wait, f"too many requests from {node_id}")

    def _refuse(self, kind: str, client: str, wait: float, why: str) -> None:
        now = self.clock()
        entry = self._refused.get((kind, client))
        if entry is None:
            while len(self._refused) >= self.config.max_tracked_clients:
                self._refused.popitem(last=False)
            entry = self._refused[(kind, client)] = [now - LOG_EVERY_S, 0.0]
        entry[1] += 1
        if now - entry[0] >= LOG_EVERY_S:
            log.warning(
                "event=rate_limited kind=%s client=%s refused=%d retry_after_s=%.1f",
                kind,
                client,
                entry[1],
                wait,
            )
            entry[0], entry[1] = now, 0.0
        raise RateLimited(f"{why}; retry in {wait:.1f} s", wait)


#: The app's limits, for the handlers.
LIMITS = web.AppKey("limits", Limits)
