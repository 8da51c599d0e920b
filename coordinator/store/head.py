"""The requests the coordinator sends to the store itself, presigned and sent with aiohttp on
the event loop: the HEAD that checks a submission, and a page of the listing that confirms a
round's submissions together (``coordinator.api.confirm``).

Through boto3 a HEAD cost about three times the CPU of a presigned HEAD sent with aiohttp
(botocore builds, signs and parses every request in Python, on a thread that holds the
interpreter lock while the loop waits), and a round made one per node. A listing page of 1,000
keys through boto3 cost about 0.2 s of that thread's CPU at the moment a round closes
(botocore's XML parser and a date parse per key), while the loop answered the round's burst of
reports; parsed here with ``xml.etree`` it takes a few milliseconds. So ``S3Store`` presigns both
and ``PresignedSender`` sends them, with the store's request timeout and a few tries on the
same transient errors boto3's "standard" retry mode retries; each outcome goes to the store's
``link``, as boto3's calls' do.
"""

from __future__ import annotations

import asyncio
import random
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote_plus

import aiohttp

from coordinator.base.errors import StorageError
from coordinator.store.object_store import ObjectInfo
from protocol.causes import cause
from protocol.links import Link

#: Tries of one request (boto3's "standard" retry mode makes as many) on a connection error or
#: a 5xx / 429 answer, with a short jittered pause between them.
ATTEMPTS = 3
RETRY_S = 0.2
_TRANSIENT = frozenset({429, 500, 502, 503, 504})


#: The namespace of every element of an S3 answer.
_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


@dataclass(frozen=True)
class ListPage:
    """One page of a listing: key -> size, and the token of the next page (``None``: the last)."""

    sizes: dict[str, int]
    next_token: str | None


def parse_list_page(body: bytes) -> ListPage:
    """A ListObjectsV2 answer asked with ``encoding-type=url`` (keys form-encoded, a space as
    ``+``, decoded as botocore decodes them); a ``StorageError`` if it is not one."""
    try:
        root = ET.fromstring(body)
        if root.tag != f"{_NS}ListBucketResult":
            raise ValueError(f"a {root.tag} element, not ListBucketResult")
        encoded = root.findtext(f"{_NS}EncodingType") == "url"
        sizes: dict[str, int] = {}
        for item in root.iterfind(f"{_NS}Contents"):
            key, size = item.findtext(f"{_NS}Key"), item.findtext(f"{_NS}Size")
            if key is None or size is None:
                raise ValueError("an entry without Key or Size")
            sizes[unquote_plus(key) if encoded else key] = int(size)
        truncated = root.findtext(f"{_NS}IsTruncated") == "true"
        token = root.findtext(f"{_NS}NextContinuationToken") if truncated else None
        if truncated and not token:
            raise ValueError("truncated without NextContinuationToken")
    except (ET.ParseError, ValueError) as exc:
        raise StorageError(f"list: the store's answer is not a listing ({exc})"[:200]) from None
    return ListPage(sizes, token)


def _error_code(body: bytes, status: int) -> str:
    """The ``<Code>`` of an S3 error answer, or the HTTP status."""
    try:
        code = ET.fromstring(body).findtext("Code")
    except ET.ParseError:
        code = None
    return code or str(status)


class PresignedSender:
    """Sends presigned requests: one aiohttp session per event loop, closed by ``close``."""

    def __init__(self, link: Link, timeout_s: float) -> None:
        self.link = link
        self.timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._http_loop is not loop:
            # One session per event loop (a test may run the store under several loops).
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            self._http, self._http_loop = aiohttp.ClientSession(timeout=timeout), loop
        return self._http

    async def _send(
        self, method: str, what: str, url: str, headers: dict[str, str]
    ) -> tuple[int, Mapping[str, str], bytes]:
        """(status, headers, body) of ``url``, tried again on a transient failure; a
        ``StorageError`` once every try failed."""
        for attempt in range(ATTEMPTS):
            if attempt:
                await asyncio.sleep(RETRY_S * (1 + random.random()) * attempt)
            try:
                async with self._session().request(method, url, headers=headers) as resp:
                    status, answer = resp.status, resp.headers.copy()  # case-insensitive
                    body = await resp.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                # ``cause`` never quotes aiohttp's text: it may carry the presigned URL.
                failure = StorageError(f"{what}: {cause(exc)}")
                self.link.failed(what, exc)
                continue
            if status in _TRANSIENT:
                failure = StorageError(f"{what}: HTTP {status}", code=str(status))
                self.link.failed(what, failure)
                continue
            self.link.answered()
            return status, answer, body
        raise failure

    async def head(self, key: str, url: str, headers: dict[str, str]) -> ObjectInfo | None:
        """HEAD ``url`` (presigned for ``key``): its size and checksum, ``None`` on 404."""
        status, answer, _ = await self._send("HEAD", f"head {key}", url, headers)
        if status == 404:
            return None
        size = answer.get("Content-Length")
        if status >= 300 or size is None:
            raise StorageError(f"head {key}: HTTP {status}", code=str(status))
        return ObjectInfo(size=int(size), sha256_b64=answer.get("x-amz-checksum-sha256"))

    async def list_page(self, prefix: str, url: str) -> ListPage:
        """One page of the listing ``url`` (presigned for the objects under ``prefix``)."""
        status, _, body = await self._send("GET", f"list {prefix}", url, {})
        if status >= 300:
            code = _error_code(body, status)
            raise StorageError(f"list {prefix}: HTTP {status} {code}"[:200], code=code)
        return parse_list_page(body)

    async def close(self) -> None:
        """Close the HTTP session (the app's shutdown)."""
        if self._http is not None:
            await self._http.close()
