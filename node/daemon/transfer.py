"""Bulk transfers through presigned URLs: the node's whole view of the object store.

A node holds no storage credentials. The coordinator hands it a presigned PUT for its own payload
key (bound to the size and the sha256, write-once) and presigned GETs for the round's gather
set; this module moves the bytes with aiohttp:

- ``put_object`` sends the body with exactly the headers the URL was signed for. A 412 means the
  object already exists (an earlier attempt of the same upload landed before a crash or a lost
  response), which is success for a write-once key of the same content.
- ``get_object`` downloads and checks size and sha256. Objects larger than ``part_size`` are
  fetched as parallel ranged GETs; a digest mismatch is a ``DigestError`` and is not retried
  (every honest node would see the same bytes).
- Either direction may be capped (``node.daemon.ratelimit``): the body is then sent or read in
  chunks at the cap's pace, and each attempt's timeout grows by the time the cap needs.
- ``HttpTransfers`` is the daemon's ``api.Transfers`` seam over both, bound to one session and
  its timeouts.

Errors (``node.errors``): ``TransferError`` for a failure a retry will not fix (its ``status``
says which), ``DigestError`` for bytes that do not match, ``RetriesExhausted`` once 5xx, 429 and
dropped connections used up their attempts.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
from yarl import URL

from node.daemon.ratelimit import CHUNK, Bandwidth, Limits
from node.daemon.retry import TRANSIENT_STATUS, Link, RetryPolicy, retry
from node.errors import DigestError, TransferError, TransientError

#: Objects above this size are downloaded as parallel ranged GETs.
PART_SIZE = 8 << 20
#: Ranged GETs in flight per object.
PARALLEL_PARTS = 4

DEFAULT_POLICY = RetryPolicy()


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


def _signed(url: str) -> URL:
    # A presigned query string must reach the server byte for byte: no re-quoting.
    return URL(url, encoded=True)


async def _read_at_most(
    resp: aiohttp.ClientResponse, limit: int, bandwidth: Bandwidth | None = None
) -> bytes:
    """The body up to ``limit`` bytes (``StreamReader.read(n)`` may return fewer: loop), read
    at ``bandwidth``'s pace when there is one."""
    chunks = []
    left = limit
    while left > 0:
        if bandwidth is not None:
            await bandwidth.take(min(left, CHUNK))
        chunk = await resp.content.read(min(left, CHUNK) if bandwidth is not None else left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _check_status(status: int, body: bytes, what: str) -> None:
    if status < 300:
        return
    text = body[:300].decode("utf-8", "replace")
    if status in TRANSIENT_STATUS:
        raise TransientError(f"{what}: HTTP {status}: {text}")
    raise TransferError(f"{what}: HTTP {status}: {text}", status)


async def put_object(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    data: bytes,
    *,
    timeouts: TransferTimeouts = DEFAULT_TIMEOUTS,
    policy: RetryPolicy = DEFAULT_POLICY,
    link: Link | None = None,
    bandwidth: Bandwidth | None = None,
) -> bool:
    """PUT ``data`` to a presigned URL. Returns False if the object already existed (412).
    With ``bandwidth`` the body goes out at its pace (with its length declared, not chunked)."""

    async def attempt() -> bool:
        body: bytes | AsyncIterator[bytes] = data
        sent = dict(headers)
        if bandwidth is not None:
            body = bandwidth.chunks(data)
            sent["Content-Length"] = str(len(data))
        timeout = timeouts.client_timeout(len(data), bandwidth)
        async with session.put(_signed(url), data=body, headers=sent, timeout=timeout) as resp:
            body = await resp.read()
            if resp.status == 412:
                return False
            _check_status(resp.status, body, "upload")
            return True

    return await retry(attempt, policy=policy, what="upload", link=link)


async def _get_range(
    session: aiohttp.ClientSession,
    url: str,
    start: int,
    end: int,
    timeouts: TransferTimeouts,
    policy: RetryPolicy,
    link: Link | None,
    bandwidth: Bandwidth | None,
) -> bytes:
    async def attempt() -> bytes:
        headers = {"Range": f"bytes={start}-{end - 1}"}
        timeout = timeouts.client_timeout(end - start, bandwidth)
        async with session.get(_signed(url), headers=headers, timeout=timeout) as resp:
            body = await _read_at_most(resp, end - start + 1, bandwidth)
            _check_status(resp.status, body, "download part")
            if len(body) != end - start:
                raise TransientError(f"download part: got {len(body)} bytes of {end - start}")
            return body

    return await retry(attempt, policy=policy, what="download part", link=link)


async def get_object(
    session: aiohttp.ClientSession,
    url: str,
    *,
    size: int,
    sha256: str,
    timeouts: TransferTimeouts = DEFAULT_TIMEOUTS,
    policy: RetryPolicy = DEFAULT_POLICY,
    part_size: int = PART_SIZE,
    link: Link | None = None,
    bandwidth: Bandwidth | None = None,
) -> bytes:
    """Download an object of known ``size`` and ``sha256`` (hex) and verify it (at
    ``bandwidth``'s pace when there is one)."""
    if size <= part_size:

        async def attempt() -> bytes:
            timeout = timeouts.client_timeout(size, bandwidth)
            async with session.get(_signed(url), timeout=timeout) as resp:
                # Read at most one byte more than promised: a longer body is a digest error,
                # and a hostile server cannot make us buffer more than that.
                body = await _read_at_most(resp, size + 1, bandwidth)
                _check_status(resp.status, body, "download")
                return body

        data = await retry(attempt, policy=policy, what="download", link=link)
    else:
        gate = asyncio.Semaphore(PARALLEL_PARTS)

        async def part(start: int) -> bytes:
            async with gate:
                end = min(size, start + part_size)
                return await _get_range(session, url, start, end, timeouts, policy, link, bandwidth)

        parts = await asyncio.gather(*(part(s) for s in range(0, size, part_size)))
        data = b"".join(parts)
    if len(data) != size:
        raise DigestError(f"download: expected {size} bytes, got {len(data)}")
    actual = hashlib.sha256(data).hexdigest()
    if actual != sha256:
        raise DigestError(f"download: sha256 {actual[:16]}... does not match {sha256[:16]}...")
    return data


class HttpTransfers:
    """``api.Transfers`` with aiohttp: one session, named timeouts, bounded retries."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        timeouts: TransferTimeouts = DEFAULT_TIMEOUTS,
        policy: RetryPolicy = DEFAULT_POLICY,
        limits: Limits | None = None,
    ) -> None:
        self.session = session
        self.timeouts = timeouts
        self.policy = policy
        self.limits = limits or Limits()
        #: Whether the object store answers; logs once per change of state.
        self.link = Link("store")

    async def put(self, url: str, headers: Mapping[str, str], data: bytes) -> bool:
        return await put_object(
            self.session,
            url,
            headers,
            data,
            timeouts=self.timeouts,
            policy=self.policy,
            link=self.link,
            bandwidth=self.limits.upload,
        )

    async def get(self, url: str, *, size: int, sha256: str) -> bytes:
        return await get_object(
            self.session,
            url,
            size=size,
            sha256=sha256,
            timeouts=self.timeouts,
            policy=self.policy,
            link=self.link,
            bandwidth=self.limits.download,
        )
