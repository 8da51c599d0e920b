"""The HEAD that checks every submission, presigned and sent with aiohttp on the event loop.

Through boto3 a HEAD cost about three times the CPU of a presigned HEAD sent with aiohttp
(botocore builds, signs and parses every request in Python, on a thread that holds the
interpreter lock while the loop waits), and a round makes one per node. So ``S3Store.head``
presigns it and ``HeadSender`` sends it, with the store's request timeout and a few tries on the
same transient errors boto3's "standard" retry mode retries; each outcome goes to the store's
``link``, as boto3's calls' do.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp

from coordinator.base.errors import StorageError
from coordinator.store.object_store import ObjectInfo
from protocol.causes import cause
from protocol.links import Link

#: Tries of one HEAD (boto3's "standard" retry mode makes as many) on a connection error or a
#: 5xx / 429 answer, with a short jittered pause between them.
HEAD_ATTEMPTS = 3
HEAD_RETRY_S = 0.2
_HEAD_TRANSIENT = frozenset({429, 500, 502, 503, 504})


class HeadSender:
    """Sends presigned HEADs: one aiohttp session per event loop, closed by ``close``."""

    def __init__(self, link: Link, timeout_s: float) -> None:
        self.link = link
        self.timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None

    async def send(self, key: str, url: str, headers: dict[str, str]) -> ObjectInfo | None:
        """HEAD ``url`` (presigned for ``key``): its size and checksum, ``None`` on 404."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._http_loop is not loop:
            # One session per event loop (a test may run the store under several loops).
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            self._http, self._http_loop = aiohttp.ClientSession(timeout=timeout), loop
        for attempt in range(HEAD_ATTEMPTS):
            if attempt:
                await asyncio.sleep(HEAD_RETRY_S * (1 + random.random()) * attempt)
            try:
                async with self._http.head(url, headers=headers) as resp:
                    status = resp.status
                    size = resp.headers.get("Content-Length")
                    checksum = resp.headers.get("x-amz-checksum-sha256")
            except (aiohttp.ClientError, TimeoutError) as exc:
                # ``cause`` never quotes aiohttp's text: it may carry the presigned URL.
                failure = StorageError(f"head {key}: {cause(exc)}")
                self.link.failed(f"head {key}", exc)
                continue
            if status in _HEAD_TRANSIENT:
                failure = StorageError(f"head {key}: HTTP {status}", code=str(status))
                self.link.failed(f"head {key}", failure)
                continue
            self.link.answered()
            if status == 404:
                return None
            if status >= 300 or size is None:
                raise StorageError(f"head {key}: HTTP {status}", code=str(status))
            return ObjectInfo(size=int(size), sha256_b64=checksum)
        raise failure

    async def close(self) -> None:
        """Close the HTTP session (the app's shutdown)."""
        if self._http is not None:
            await self._http.close()
