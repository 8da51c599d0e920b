"""Bodies streamed between the network and local files, off the event loop.

``node.daemon.transfer`` moves objects too large to hold (a checkpoint of a model that no process
holds whole) through local files; this module is the disk side of it: bytes go to and from the
file in ``WRITE_CHUNK`` pieces on the default executor's threads, so the event loop never waits
on the disk and a transfer holds one piece per part in flight.

- ``body_to_file``: a response body into a file at an offset, never past the bytes it owns (a
  ranged part that runs long cannot overwrite its neighbour), what came written even when the
  connection drops, so the read can resume there;
- ``PartsSha``: the sha256 of a file whose parts land out of order, each read back (from the page
  cache) once every part before it has been, while later parts still download;
- ``file_chunks``: a file as an upload body, at a bandwidth cap's pace when there is one;
- ``in_thread``: a call on a thread whose cancellation waits for the call to end, so a file is
  never closed under a read or write still running.

Errors of the file system are ``node.errors.TransferError`` naming what failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any, BinaryIO, TypeVar

import aiohttp

from node.daemon.ratelimit import CHUNK, Bandwidth
from node.errors import TransferError

#: Bytes gathered before one write to (or read from) disk: one hop to a thread per MiB, and
#: what a transfer holds in memory per part in flight.
WRITE_CHUNK = 1 << 20

T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the default executor. If the caller is cancelled the call still ends
    before the cancellation goes on, so the file it uses is never closed under it."""
    future = asyncio.get_running_loop().run_in_executor(None, fn, *args)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait([future])
        raise


def _write_at(
    fd: int, data: bytearray, pos: int, sha: Any, landed: Callable[[int], None] | None = None
) -> None:
    """``data`` into ``fd`` at ``pos`` (and into ``sha`` when there is one); then ``landed``
    hears how many bytes, on this same thread: the write and its count go together, even when
    the caller was cancelled meanwhile (``in_thread`` lets the call end first)."""
    view = memoryview(data)
    if sha is not None:
        sha.update(view)
    try:
        while view:
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n
    except OSError as exc:
        raise TransferError(f"download: cannot write the file: {exc.strerror or exc}") from exc
    if landed is not None:
        landed(len(data))


async def body_to_file(
    resp: aiohttp.ClientResponse,
    fd: int,
    offset: int,
    n: int,
    bandwidth: Bandwidth | None,
    sha: Any = None,
    on_write: Callable[[int], None] | None = None,
) -> int:
    """The body into ``fd`` from ``offset``, at most ``n`` bytes of it (at ``bandwidth``'s pace
    when there is one); how many bytes came: ``n + 1`` at most, the one over never written.

    ``on_write`` hears of every piece written. If the connection drops mid-body, what came is
    written before the error goes on, so a resumed read can start at the first byte missing
    (``node.daemon.ranged``)."""
    got = written = 0
    pending = bytearray()

    def landed(n: int) -> None:
        nonlocal written
        written += n
        if on_write is not None:
            on_write(n)

    async def flush() -> None:
        nonlocal pending
        data, pending = pending, bytearray()
        await in_thread(_write_at, fd, data, offset + written, sha, landed)

    while got <= n:
        # Small reads: the stream's own pieces, not a join of them into one more large copy.
        try:
            chunk = await resp.content.read(min(n + 1 - got, CHUNK))
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ConnectionError):
            if pending:
                await flush()
            raise
        if not chunk:
            break
        if bandwidth is not None:  # what came, not what was asked for: a read may return less
            await bandwidth.take(len(chunk))
        got += len(chunk)
        pending += chunk
        if len(pending) >= WRITE_CHUNK or got > n:
            if got > n:  # the byte over belongs to no one here
                del pending[n - written :]
            await flush()
    if pending:
        await flush()
    return got


class PartsSha:
    """sha256 of a file whose parts land out of order: each part is read back and hashed once
    every part before it has been."""

    def __init__(self, fd: int, size: int, part_size: int) -> None:
        self.fd, self.size, self.part_size = fd, size, part_size
        self.sha = hashlib.sha256()
        self._landed: set[int] = set()
        self._next = 0
        self._lock = asyncio.Lock()

    async def landed(self, index: int) -> None:
        self._landed.add(index)
        async with self._lock:  # one reader, in order; the others only add to _landed
            while self._next in self._landed:
                start = self._next * self.part_size
                await in_thread(self._hash, start, min(self.size, start + self.part_size))
                self._next += 1

    def _hash(self, pos: int, end: int) -> None:
        try:
            while pos < end:
                chunk = os.pread(self.fd, min(WRITE_CHUNK, end - pos), pos)
                if not chunk:
                    raise TransferError(f"download: the file ends at {pos} of {end} bytes")
                self.sha.update(chunk)
                pos += len(chunk)
        except OSError as exc:
            raise TransferError(f"download: cannot read the file: {exc.strerror or exc}") from exc

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


async def file_chunks(f: BinaryIO, size: int, bandwidth: Bandwidth | None) -> AsyncIterator[bytes]:
    """``size`` bytes of ``f`` in pieces read on a thread, at ``bandwidth``'s pace if any."""
    step = WRITE_CHUNK if bandwidth is None else max(1, min(CHUNK, int(bandwidth.capacity)))
    left = size
    while left:
        chunk = await in_thread(f.read, min(step, left))
        if not chunk:  # the file shrank since it was measured: this attempt fails
            raise TransferError(f"upload: the file ended {left} bytes early")
        if bandwidth is not None:
            await bandwidth.take(len(chunk))
        left -= len(chunk)
        yield chunk
