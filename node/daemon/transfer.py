"""Bulk transfers through presigned URLs: the node's whole view of the object store.

A node holds no storage credentials. The coordinator hands it a presigned PUT for its own payload
key (bound to the size and the sha256, write-once) and presigned GETs for the round's gather
set; this module moves the bytes with aiohttp:

- ``put_object`` sends the body with exactly the headers the URL was signed for. A 412 means the
  object already exists (an earlier attempt of the same upload landed before a crash or a lost
  response), which is success for a write-once key of the same content.
- ``get_object`` downloads and checks size and sha256. Objects larger than ``part_size`` are
  fetched as parallel ranged GETs; a body cut by a reset goes on from the byte it reached
  (``node.daemon.ranged``), one GET or one part alike; a digest mismatch is a ``DigestError``
  and is not retried (every honest node would see the same bytes).
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
- An upload granted in parts (``node.daemon.multipart``) goes through ``put_parts`` and
  ``put_file_parts`` of ``HttpTransfers``.
- ``HttpTransfers`` is the daemon's ``api.Transfers`` seam over all of them, bound to one
  session and its timeouts; its ``counts`` tally the ranges resumed and the parts resent.

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
from pathlib import Path

import aiohttp

from node.daemon.filestream import PartsSha, file_chunks, in_thread
from node.daemon.multipart import all_or_none, put_file_parts, put_parts
from node.daemon.ranged import ObjectGet, check_status, fetch_range, range_to_file, signed
from node.daemon.ratelimit import Bandwidth, Limits
from node.daemon.retry import Link, RetryPolicy, retry
from node.daemon.transferopts import (
    DEFAULT_OPTIONS,
    DEFAULT_POLICY,
    DEFAULT_TIMEOUTS,
    TransferCounts,
    TransferOptions,
    TransferTimeouts,
)
from node.errors import DigestError, TransferError
from protocol.parts import CompletedPart, MultipartGrant

#: Objects above this size are downloaded as parallel ranged GETs.
PART_SIZE = 8 << 20
#: Ranged GETs in flight per object.
PARALLEL_PARTS = 4


async def put_object(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    data: bytes,
    options: TransferOptions = DEFAULT_OPTIONS,
) -> bool:
    """PUT ``data`` to a presigned URL. Returns False if the object already existed (412).
    Under a ``bandwidth`` cap the body goes out at its pace (its length declared, not chunked)."""

    async def attempt() -> bool:
        body: bytes | AsyncIterator[bytes] = data
        sent = dict(headers)
        if options.bandwidth is not None:
            body = options.bandwidth.chunks(data)
            sent["Content-Length"] = str(len(data))
        return await _put_once(session, url, body, sent, options.timeout(len(data)))

    return await retry(attempt, policy=options.policy, what="upload", link=options.link)


async def _put_once(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes | AsyncIterator[bytes],
    headers: Mapping[str, str],
    timeout: aiohttp.ClientTimeout,
) -> bool:
    """One attempt at a write-once PUT: True once stored, False if the object already existed
    (412), an error for any other failure."""
    async with session.put(signed(url), data=body, headers=headers, timeout=timeout) as resp:
        text = await resp.read()
        if resp.status == 412:
            return False
        check_status(resp.status, text, "upload")
        return True


async def get_object(
    session: aiohttp.ClientSession,
    url: str,
    *,
    size: int,
    sha256: str,
    options: TransferOptions = DEFAULT_OPTIONS,
    part_size: int = PART_SIZE,
) -> bytes:
    """Download an object of known ``size`` and ``sha256`` (hex) and verify it (at the
    ``bandwidth``'s pace when there is one); a cut body is resumed where it stopped."""
    get = ObjectGet(session, url, options)
    if size <= part_size:
        timeout = options.timeout(size)
        data = await fetch_range(get, 0, size, ranged=False, timeout=timeout, what="download")
    else:
        gate = asyncio.Semaphore(PARALLEL_PARTS)

        async def part(start: int) -> bytes:
            end = min(size, start + part_size)
            timeout = options.timeout(end - start)
            async with gate:
                return await fetch_range(get, start, end, ranged=True, timeout=timeout)

        data = b"".join(await all_or_none([part(s) for s in range(0, size, part_size)]))
    _check_size(len(data), size)
    _check_sha256(hashlib.sha256(data).hexdigest(), sha256)
    return data


def _check_size(got: int, size: int) -> None:
    if got != size:
        raise DigestError(f"download: expected {size} bytes, got {got}")


def _check_sha256(actual: str, sha256: str) -> None:
    if actual != sha256:
        raise DigestError(f"download: sha256 {actual[:16]}... does not match {sha256[:16]}...")


async def get_to_file(
    session: aiohttp.ClientSession,
    url: str,
    path: Path,
    *,
    size: int,
    sha256: str,
    options: TransferOptions = DEFAULT_OPTIONS,
    part_size: int = PART_SIZE,
) -> None:
    """Download an object of known ``size`` and ``sha256`` (hex) to ``path``, holding at most
    ``filestream.WRITE_CHUNK`` bytes per part in flight; ``path`` appears only once the file
    checks out (``DigestError`` otherwise, and nothing is left behind)."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    except OSError as exc:
        raise TransferError(f"download: cannot write in {path.parent}: {exc.strerror}") from exc
    get = ObjectGet(session, url, options)
    try:
        if size <= part_size:
            sha = hashlib.sha256()
            timeout = options.timeout(size)
            got = await range_to_file(
                get, fd, 0, size, ranged=False, timeout=timeout, sha=sha, what="download"
            )
            _check_size(got, size)
            actual = sha.hexdigest()
        else:
            actual = await _parts_to_file(get, fd, size, part_size)
        _check_sha256(actual, sha256)
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


async def _parts_to_file(get: ObjectGet, fd: int, size: int, part_size: int) -> str:
    """Parallel ranged GETs written at their offsets, each retried (and resumed) alone; the
    file's sha256."""
    gate = asyncio.Semaphore(PARALLEL_PARTS)
    sha = PartsSha(fd, size, part_size)

    async def part(index: int) -> None:
        start = index * part_size
        end = min(size, start + part_size)
        timeout = get.options.timeout(end - start)
        async with gate:
            got = await range_to_file(get, fd, start, end, ranged=True, timeout=timeout)
        if got != end - start:  # a store that sent more than the range asked for
            raise TransferError(f"download part: got {got} bytes of {end - start}")
        await sha.landed(index)

    # On a failure the other parts stop, and have stopped, before the file is closed.
    await all_or_none([part(i) for i in range(-(-size // part_size))])
    return sha.hexdigest()


async def put_file(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str],
    path: Path,
    *,
    size: int,
    options: TransferOptions = DEFAULT_OPTIONS,
) -> bool:
    """PUT the ``size`` bytes of the local file ``path`` to a presigned URL, streamed from disk
    with its length declared (at the ``bandwidth``'s pace when there is one). Returns False if the
    object already existed (412); ``TransferError`` if the file does not hold ``size`` bytes."""
    try:
        found = os.stat(path).st_size
    except OSError as exc:
        raise TransferError(f"upload: cannot read {path}: {exc.strerror}") from exc
    if found != size:
        raise TransferError(f"upload: {path} holds {found} bytes, not {size}")

    async def attempt() -> bool:
        sent = {**headers, "Content-Length": str(size)}
        with open(path, "rb", buffering=0) as f:
            body = file_chunks(f, size, options.bandwidth)
            return await _put_once(session, url, body, sent, options.timeout(size))

    return await retry(attempt, policy=options.policy, what="upload", link=options.link)


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
        #: Ranges resumed and upload parts retried, over the node's life.
        self.counts = TransferCounts()

    @property
    def upload(self) -> TransferOptions:
        """The options of every upload: this seam's timeouts, policy, link and counts, the
        upload cap."""
        return self._options(self.limits.upload)

    @property
    def download(self) -> TransferOptions:
        """The options of every download, under the download cap."""
        return self._options(self.limits.download)

    def _options(self, bandwidth: Bandwidth | None) -> TransferOptions:
        return TransferOptions(self.timeouts, self.policy, self.link, bandwidth, self.counts)

    async def put_parts(
        self, grant: MultipartGrant, data: bytes, done: dict[int, CompletedPart] | None = None
    ) -> list[CompletedPart]:
        return await put_parts(self.session, grant, data, self.upload, done)

    async def put_file_parts(
        self, grant: MultipartGrant, path: Path, *, size: int
    ) -> list[CompletedPart]:
        return await put_file_parts(self.session, grant, path, size, self.upload)

    async def put(self, url: str, headers: Mapping[str, str], data: bytes) -> bool:
        return await put_object(self.session, url, headers, data, self.upload)

    async def get(self, url: str, *, size: int, sha256: str) -> bytes:
        return await get_object(self.session, url, size=size, sha256=sha256, options=self.download)

    async def put_file(
        self, url: str, headers: Mapping[str, str], path: Path, *, size: int
    ) -> bool:
        return await put_file(self.session, url, headers, path, size=size, options=self.upload)

    async def get_to_file(self, url: str, path: Path, *, size: int, sha256: str) -> None:
        await get_to_file(self.session, url, path, size=size, sha256=sha256, options=self.download)
