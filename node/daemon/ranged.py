"""Resumable reads of one byte range of an object: a reset costs the bytes in flight, not the part.

A download from the store is one GET (small objects) or parallel ranged GETs of ``PART_SIZE``
(``node.daemon.transfer``). Over a home link a connection may be reset in the middle of a body;
restarting the part from its first byte would throw away what already arrived, and on a link
that resets every minute a large part might never finish. So each range here keeps what it
received, and the next attempt asks for the rest only (``Range: bytes={reached}-{end}``):

- ``fetch_range`` into memory: every byte read is kept, the next attempt starts at the first
  byte not received;
- ``range_to_file`` into a file at the range's offset: bytes are written in pieces of
  ``filestream.WRITE_CHUNK``; after a dropped connection the piece still in memory is written
  first, then the next attempt starts at the first byte not on disk.

Every ranged answer must be ``206`` with a ``Content-Range`` that starts where it was asked to
(else the attempt fails and is retried): a store that ignored the ``Range`` would otherwise
splice the object's first bytes in the middle. A cut body is an error of the connection (the
store promised more in its ``Content-Length``); a body that ends cleanly short, or a 416, means
the object is shorter than promised: a ``DigestError``, like any other object that does not
match (every node sees the same bytes, and drops the same payload).
Each attempt is one attempt of ``node.daemon.retry`` (the same timeouts, statuses and budget as
any transfer); the ``TransferCounts`` of its ``TransferOptions`` (``node.daemon.transferopts``)
tally the resumes, so that benchmarks and tests can show resets happened mid-transfer.
The caller still checks the whole object's size and sha256.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import aiohttp
from yarl import URL

from node.daemon.filestream import body_to_file
from node.daemon.ratelimit import CHUNK, Bandwidth
from node.daemon.retry import TRANSIENT_STATUS, retry
from node.daemon.transferopts import TransferOptions
from node.errors import DigestError, TransferError, TransientError

log = logging.getLogger("sparseloco.transfer")

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def signed(url: str) -> URL:
    """A presigned URL as aiohttp must send it: byte for byte, no re-quoting."""
    return URL(url, encoded=True)


def check_status(status: int, body: bytes, what: str) -> None:
    """Raise for an error status: ``TransientError`` if a retry may fix it, else
    ``TransferError``, with the start of the body the store sent."""
    if status < 300:
        return
    text = body[:300].decode("utf-8", "replace")
    if status in TRANSIENT_STATUS:
        raise TransientError(f"{what}: HTTP {status}: {text}", status)
    raise TransferError(f"{what}: HTTP {status}: {text}", status)


async def read_at_most(
    resp: aiohttp.ClientResponse, limit: int, bandwidth: Bandwidth | None = None
) -> bytes:
    """The body up to ``limit`` bytes, at ``bandwidth``'s pace when there is one."""
    buf = bytearray()
    await _read_into(resp, buf, limit, bandwidth)
    return bytes(buf)


async def _read_into(
    resp: aiohttp.ClientResponse, buf: bytearray, limit: int, bandwidth: Bandwidth | None
) -> None:
    """Append up to ``limit`` bytes of the body to ``buf``, keeping what came if it breaks."""
    left = limit
    while left > 0:
        if bandwidth is not None:
            await bandwidth.take(min(left, CHUNK))
        chunk = await resp.content.read(min(left, CHUNK) if bandwidth is not None else left)
        if not chunk:
            break
        buf += chunk
        left -= len(chunk)


async def failed(resp: aiohttp.ClientResponse, what: str) -> None:
    """Raise for an error status, with the start of the body the store sent with it."""
    if resp.status >= 300:
        check_status(resp.status, await read_at_most(resp, 300), what)


async def answered(resp: aiohttp.ClientResponse, pos: int, what: str) -> None:
    """Raise unless ``resp`` brings the bytes from ``pos`` on: for an error status (a 416: the
    object ends before ``pos``, shorter than promised, a ``DigestError``), or a ranged answer
    that does not start there."""
    if resp.status == 416:
        raise DigestError(f"{what}: the object ends before byte {pos}: shorter than promised")
    await failed(resp, what)
    if "Range" in resp.request_info.headers:
        check_range(resp, pos, what)


def check_range(resp: aiohttp.ClientResponse, pos: int, what: str) -> None:
    """A ranged answer must be 206 and start at ``pos``; anything else is not our bytes (a
    transient failure: a proxy's mistake, a store that ignored the range once)."""
    found = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
    if resp.status != 206 or found is None or int(found.group(1)) != pos:
        raise TransientError(
            f"{what}: asked for bytes from {pos}, got HTTP {resp.status}"
            f" Content-Range {resp.headers.get('Content-Range')!r}",
            resp.status,
        )


@dataclass(frozen=True)
class ObjectGet:
    """The GETs of one object: its presigned ``url`` on ``session``, each attempt retried, paced
    and its resumes tallied as ``options`` say."""

    session: aiohttp.ClientSession
    url: str
    options: TransferOptions

    def headers(self, start: int, pos: int, end: int, *, ranged: bool, what: str) -> dict[str, Any]:
        """The headers of an attempt at bytes ``start``..``end`` that begins at ``pos``: a
        ``Range`` when one was asked for or when it resumes (a resume is counted)."""
        headers: dict[str, Any] = {}
        if ranged or pos > start:
            headers["Range"] = f"bytes={pos}-{end - 1}"
        if pos > start:
            counts = self.options.counts
            if counts is not None:
                counts.resumed_ranges += 1
                counts.bytes_kept += pos - start
            log.debug("event=range_resumed what=%r start=%d from=%d", what, start, pos)
        return headers


async def fetch_range(
    get: ObjectGet,
    start: int,
    end: int,
    *,
    ranged: bool,
    timeout: aiohttp.ClientTimeout,
    what: str = "download part",
) -> bytes:
    """Bytes ``start``..``end`` of the object, resumed after every cut body.

    ``ranged=False`` asks for the whole object with a plain GET first (``start`` is then 0)
    and reads one byte past ``end`` at most: a longer object shows as more bytes than promised
    (the caller's size check), and never makes us buffer more than that.
    """
    buf = bytearray()

    async def attempt() -> bytes:
        pos = start + len(buf)
        headers = get.headers(start, pos, end, ranged=ranged, what=what)
        async with get.session.get(signed(get.url), headers=headers, timeout=timeout) as resp:
            await answered(resp, pos, what)
            # One byte more than asked for at most (see above); a cut body keeps what came.
            await _read_into(resp, buf, end + 1 - pos, get.options.bandwidth)
        if len(buf) < end - start:  # the body ended cleanly: the object is shorter
            raise DigestError(f"{what}: expected {end - start} bytes, got {len(buf)}")
        return bytes(buf)

    return await retry(attempt, policy=get.options.policy, what=what, link=get.options.link)


async def range_to_file(
    get: ObjectGet,
    fd: int,
    start: int,
    end: int,
    *,
    ranged: bool,
    timeout: aiohttp.ClientTimeout,
    sha: Any = None,
    what: str = "download part",
) -> int:
    """Bytes ``start``..``end`` of the object into ``fd`` at their offsets, resumed after every
    cut body; ``sha`` (if any) hashes them in order as they are written. Returns how many
    bytes came: ``end - start``, or one more for a plain GET of an object longer than promised
    (that byte is never written)."""
    written = 0

    def landed(n: int) -> None:
        nonlocal written
        written += n

    async def attempt() -> int:
        pos = start + written
        headers = get.headers(start, pos, end, ranged=ranged, what=what)
        async with get.session.get(signed(get.url), headers=headers, timeout=timeout) as resp:
            await answered(resp, pos, what)
            got = await body_to_file(resp, fd, pos, end - pos, get.options.bandwidth, sha, landed)
        if pos + got > end:
            return written + 1  # one byte over: the caller's size check says so
        if written < end - start:  # the body ended cleanly: the object is shorter
            raise DigestError(f"{what}: expected {end - start} bytes, got {written}")
        return written

    return await retry(attempt, policy=get.options.policy, what=what, link=get.options.link)
