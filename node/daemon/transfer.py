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
- ``get_to_file`` and ``put_file`` do the same with a local file, for objects too large to hold
  (a checkpoint of a model no process holds whole), streamed through in pieces of
  ``filestream.WRITE_CHUNK``. A download goes to a temporary name in the target's folder,
  ranged parts written at their offsets, and is renamed into place only once its size and
  sha256 check out. One GET is hashed as it streams; ranged parts land out of order, so each is
  read back from the file (the page cache, while later parts still download) once every part
  before it has been, which proves the bytes on disk, not only the bytes received.
  ``node.daemon.filestream`` is their disk side.
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
import os
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from yarl import URL

from node.daemon.filestream import PartsSha, body_to_file, file_chunks, in_thread
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
        raise TransientError(f"{what}: HTTP {status}: {text}", status)
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


async def _failed(resp: aiohttp.ClientResponse, what: str) -> None:
    """Raise for an error status, with the start of the body the store sent with it."""
    if resp.status >= 300:
        _check_status(resp.status, await _read_at_most(resp, 300), what)


async def get_to_file(
    session: aiohttp.ClientSession,
    url: str,
    path: Path,
    *,
    size: int,
    sha256: str,
    timeouts: TransferTimeouts = DEFAULT_TIMEOUTS,
    policy: RetryPolicy = DEFAULT_POLICY,
    part_size: int = PART_SIZE,
    link: Link | None = None,
    bandwidth: Bandwidth | None = None,
) -> None:
    """Download an object of known ``size`` and ``sha256`` (hex) to ``path``, holding at most
    ``filestream.WRITE_CHUNK`` bytes per part in flight; ``path`` appears only once the file
    checks out (``DigestError`` otherwise, and nothing is left behind)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    except OSError as exc:
        raise TransferError(f"download: cannot write in {path.parent}: {exc.strerror}") from exc
    try:
        if size <= part_size:

            async def attempt() -> str:
                sha = hashlib.sha256()
                timeout = timeouts.client_timeout(size, bandwidth)
                async with session.get(_signed(url), timeout=timeout) as resp:
                    await _failed(resp, "download")
                    # One byte more than promised at most: a longer body is a digest error.
                    got = await body_to_file(resp, fd, 0, size, bandwidth, sha)
                if got != size:
                    raise DigestError(f"download: expected {size} bytes, got {got}")
                return sha.hexdigest()

            actual = await retry(attempt, policy=policy, what="download", link=link)
        else:
            actual = await _parts_to_file(
                session, url, fd, size, part_size, timeouts, policy, link, bandwidth
            )
        if actual != sha256:
            raise DigestError(f"download: sha256 {actual[:16]}... does not match {sha256[:16]}...")
        await in_thread(os.ftruncate, fd, size)  # nothing of an earlier, longer attempt
        await in_thread(os.fsync, fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise


async def _parts_to_file(
    session: aiohttp.ClientSession,
    url: str,
    fd: int,
    size: int,
    part_size: int,
    timeouts: TransferTimeouts,
    policy: RetryPolicy,
    link: Link | None,
    bandwidth: Bandwidth | None,
) -> str:
    """Parallel ranged GETs written at their offsets, each retried alone; the file's sha256."""
    gate = asyncio.Semaphore(PARALLEL_PARTS)
    sha = PartsSha(fd, size, part_size)

    async def part(index: int) -> None:
        start = index * part_size
        end = min(size, start + part_size)

        async def attempt() -> None:
            headers = {"Range": f"bytes={start}-{end - 1}"}
            timeout = timeouts.client_timeout(end - start, bandwidth)
            async with session.get(_signed(url), headers=headers, timeout=timeout) as resp:
                await _failed(resp, "download part")
                got = await body_to_file(resp, fd, start, end - start, bandwidth)
            if got != end - start:
                raise TransientError(f"download part: got {got} bytes of {end - start}")

        async with gate:
            await retry(attempt, policy=policy, what="download part", link=link)
        await sha.landed(index)

    tasks = [asyncio.ensure_future(part(i)) for i in range(-(-size // part_size))]
    try:
        await asyncio.gather(*tasks)
    finally:
        # On a failure the other parts stop, and have stopped, before the file is closed.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return sha.hexdigest()


async def put_file(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    path: Path,
    *,
    size: int,
    timeouts: TransferTimeouts = DEFAULT_TIMEOUTS,
    policy: RetryPolicy = DEFAULT_POLICY,
    link: Link | None = None,
    bandwidth: Bandwidth | None = None,
) -> bool:
    """PUT the ``size`` bytes of the local file ``path`` to a presigned URL, streamed from disk
    with its length declared (at ``bandwidth``'s pace when there is one). Returns False if the
    object already existed (412); ``TransferError`` if the file does not hold ``size`` bytes."""
    try:
        found = os.stat(path).st_size
    except OSError as exc:
        raise TransferError(f"upload: cannot read {path}: {exc.strerror}") from exc
    if found != size:
        raise TransferError(f"upload: {path} holds {found} bytes, not {size}")

    async def attempt() -> bool:
        sent = {**headers, "Content-Length": str(size)}
        timeout = timeouts.client_timeout(size, bandwidth)
        with open(path, "rb", buffering=0) as f:
            body = file_chunks(f, size, bandwidth)
            async with session.put(_signed(url), data=body, headers=sent, timeout=timeout) as resp:
                text = await resp.read()
                if resp.status == 412:
                    return False
                _check_status(resp.status, text, "upload")
                return True

    return await retry(attempt, policy=policy, what="upload", link=link)


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

    async def put_file(
        self, url: str, headers: Mapping[str, str], path: Path, *, size: int
    ) -> bool:
        return await put_file(
            self.session,
            url,
            headers,
            path,
            size=size,
            timeouts=self.timeouts,
            policy=self.policy,
            link=self.link,
            bandwidth=self.limits.upload,
        )

    async def get_to_file(self, url: str, path: Path, *, size: int, sha256: str) -> None:
        await get_to_file(
            self.session,
            url,
            path,
            size=size,
            sha256=sha256,
            timeouts=self.timeouts,
            policy=self.policy,
            link=self.link,
            bandwidth=self.limits.download,
        )
