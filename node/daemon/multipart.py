"""Uploads in parts, from the node's side: cut, upload each part alone, report what landed.

An object of ``MULTIPART_THRESHOLD`` bytes or more goes to the store as an S3 multipart upload
(``protocol.parts`` has the protocol): ``part_plan`` cuts it into parts of ``UPLOAD_PART_SIZE``
and hashes each; the coordinator answers a grant with one presigned URL per part, each bound to
the part's length and sha256; ``put_parts`` (bytes in memory) and ``put_file_parts`` (a local
file, read a piece at a time) send ``PARALLEL_UPLOADS`` parts at a time, each retried alone
(``node.daemon.retry``: a reset costs that part, not the object). The ETags the store answers
go back to the coordinator, which completes the upload write-once.

Below the threshold an object goes as one presigned PUT, as it always has: one request instead
of three, and nothing to clean up if the node dies half way.

Settings (module constants, read at the call, so a test may lower them):

- ``MULTIPART_THRESHOLD`` (64 MiB): at 20 Mbit/s up, 27 s of upload, about where a reset every
  minute starts to cost a whole PUT more often than not;
- ``UPLOAD_PART_SIZE`` (8 MiB, at least S3's 5 MiB): what one reset costs at most per part in
  flight; 8 MiB parts keep a 70 B model's 1.3 GB payload at 160 parts, far from S3's 10,000;
- ``PARALLEL_UPLOADS`` (4): parts in flight, so one slow connection does not idle the link.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from node.daemon.filestream import WRITE_CHUNK, file_chunks
from node.daemon.ranged import check_status, signed
from node.daemon.ratelimit import Bandwidth
from node.daemon.retry import retry
from node.daemon.transferopts import TransferOptions
from node.errors import TransferError, TransientError
from protocol.parts import (
    MAX_PARTS,
    CompletedPart,
    MultipartGrant,
    PartPlan,
    PartUrl,
    part_digests,
    part_ranges,
)

log = logging.getLogger("sparseloco.transfer")

T = TypeVar("T")

#: Objects of this many bytes or more are uploaded in parts.
MULTIPART_THRESHOLD = 64 << 20
#: Bytes of every part but the last.
UPLOAD_PART_SIZE = 8 << 20
#: Parts uploaded at once per object.
PARALLEL_UPLOADS = 4


def part_size_for(size: int) -> int:
    """``UPLOAD_PART_SIZE``, or for an object that would need more than S3's ``MAX_PARTS``
    parts of it (past 78 GiB: a checkpoint of a model of tens of billions of parameters), the
    smallest whole number of MiB that cuts it into ``MAX_PARTS``."""
    fewest = -(-size // MAX_PARTS)
    return max(UPLOAD_PART_SIZE, -(-fewest // (1 << 20)) << 20)


def part_plan(data: bytes | memoryview) -> PartPlan | None:
    """How ``data`` is cut for a multipart upload; ``None`` below ``MULTIPART_THRESHOLD``
    (one PUT). Hashes every part: call it off the event loop for a large object."""
    if len(data) < MULTIPART_THRESHOLD:
        return None
    part_size = part_size_for(len(data))
    return PartPlan(part_size=part_size, sha256=part_digests(data, part_size))


def file_part_plan(path: Path, size: int) -> PartPlan | None:
    """``part_plan`` of the ``size`` bytes of a local file, read a piece at a time."""
    if size < MULTIPART_THRESHOLD:
        return None
    part_size = part_size_for(size)
    digests = []
    with open(path, "rb", buffering=0) as f:
        for start, end in part_ranges(size, part_size):
            sha = hashlib.sha256()
            for pos in range(start, end, WRITE_CHUNK):
                sha.update(os.pread(f.fileno(), min(WRITE_CHUNK, end - pos), pos))
            digests.append(sha.hexdigest())
    return PartPlan(part_size=part_size, sha256=digests)


def _sha_hex(part: PartUrl) -> str:
    """The part's sha256 (hex), from the checksum header its URL was signed with."""
    for name, value in part.headers.items():
        if name.lower() == "x-amz-checksum-sha256":
            return base64.b64decode(value).hex()
    raise TransferError(f"upload part {part.number}: the grant signs no sha256 for it")


async def _send_parts(
    grant: MultipartGrant,
    size: int,
    send: Callable[[PartUrl, int, int], Awaitable[str]],
    options: TransferOptions,
    done: dict[int, CompletedPart] | None,
) -> list[CompletedPart]:
    """Every part of ``grant`` through ``send(part, start, end) -> etag``, ``PARALLEL_UPLOADS``
    at a time, each retried alone (as ``options`` say); the parts in order, as the completion
    lists them. Parts in ``done`` (by number) are not sent again, and each part the store takes
    is added to it: a caller whose upload failed part way sends only the rest with the same
    grant."""
    done = {} if done is None else done
    ranges = part_ranges(size, grant.part_size)
    if [p.number for p in grant.parts] != list(range(1, len(ranges) + 1)):
        raise TransferError(f"upload: the grant's parts do not cut {size} bytes")
    gate = asyncio.Semaphore(PARALLEL_UPLOADS)

    async def one(part: PartUrl, start: int, end: int) -> CompletedPart:
        if part.number in done:
            return done[part.number]
        tries = 0

        async def attempt() -> str:
            nonlocal tries
            tries += 1
            if tries > 1:
                if options.counts is not None:
                    options.counts.retried_parts += 1
                log.debug("event=part_retried number=%d attempt=%d", part.number, tries)
            return await send(part, start, end)

        async with gate:
            etag = await retry(
                attempt, policy=options.policy, what="upload part", link=options.link
            )
        done[part.number] = CompletedPart(number=part.number, etag=etag, sha256=_sha_hex(part))
        return done[part.number]

    parts = zip(grant.parts, ranges, strict=True)
    return await all_or_none([one(part, s, e) for part, (s, e) in parts])


async def all_or_none(coros: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` at once; their results in order. When one fails for good the others are
    cancelled, and have stopped, before its error is raised (none is left running)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pieces(view: memoryview, bandwidth: Bandwidth | None) -> AsyncIterator[bytes]:
    """A part in memory as a stream of ``WRITE_CHUNK`` pieces (at ``bandwidth``'s pace when
    there is one). A stream, not bytes: aiohttp would resend bytes by itself, once, when a
    kept-alive connection drops; a stream it cannot, so every resend of a part is an attempt
    of ``retry``, paced, logged and counted like the others."""
    if bandwidth is not None:
        async for piece in bandwidth.chunks(view.tobytes()):
            yield piece
        return
    for pos in range(0, len(view), WRITE_CHUNK):
        yield view[pos : pos + WRITE_CHUNK].tobytes()


async def _put_part(
    session: aiohttp.ClientSession,
    part: PartUrl,
    data: AsyncIterator[bytes],
    length: int,
    timeout: aiohttp.ClientTimeout,
) -> str:
    """One ``UploadPart`` with exactly the signed headers (``data`` a stream: see
    ``_pieces``); the ETag the store answers."""
    sent: Mapping[str, str] = {**part.headers, "Content-Length": str(length)}
    async with session.put(signed(part.url), data=data, headers=sent, timeout=timeout) as resp:
        text = await resp.read()
        check_status(resp.status, text, f"upload part {part.number}")
        etag = resp.headers.get("ETag")
    if not etag:
        raise TransientError(f"upload part {part.number}: the store answered no ETag")
    return etag


async def put_parts(
    session: aiohttp.ClientSession,
    grant: MultipartGrant,
    data: bytes,
    options: TransferOptions,
    done: dict[int, CompletedPart] | None = None,
) -> list[CompletedPart]:
    """Upload ``data`` through ``grant``'s part URLs (but those in ``done``), each part's
    attempts as ``options`` say; the parts for the completion."""
    view = memoryview(data)

    async def send(part: PartUrl, start: int, end: int) -> str:
        body = _pieces(view[start:end], options.bandwidth)
        return await _put_part(session, part, body, end - start, options.timeout(end - start))

    return await _send_parts(grant, len(data), send, options, done)


async def put_file_parts(
    session: aiohttp.ClientSession,
    grant: MultipartGrant,
    path: Path,
    size: int,
    options: TransferOptions,
) -> list[CompletedPart]:
    """Upload the ``size`` bytes of the file at ``path`` through ``grant``'s part URLs, each
    part streamed from disk; the parts for the completion."""

    async def send(part: PartUrl, start: int, end: int) -> str:
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            body = file_chunks(f, end - start, options.bandwidth)
            return await _put_part(session, part, body, end - start, options.timeout(end - start))

    return await _send_parts(grant, size, send, options, None)
