"""An HTTP proxy in front of a real S3 store that makes it behave like a store with fewer promises.

SeaweedFS keeps ``If-None-Match: *``; other stores do not (``docs/stores.md``). The header is
part of every signature that carries it, so a proxy cannot just drop it. Instead ``S3Proxy``
forwards each request unchanged (the ``Host`` the client signed for included) and, by mode:

- ``"overwrite"``: a store that ignores ``If-None-Match``. Before it forwards a PUT of an object
  or a CompleteMultipartUpload that carries the header, it deletes the key with the store's own
  credentials, so the write lands and replaces whatever was there, as on such a store;
- ``"refuse"``: a store that refuses the header (Backblaze B2): any request that carries it
  gets ``501 NotImplemented`` and never reaches the store.

It serves on a free loopback port from a thread of its own (its own event loop), so real
coordinator and node processes can use it as their endpoint. ``requests`` counts what passed.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any
from urllib.parse import unquote, urlsplit

import aiohttp
from aiohttp import web

from node.cluster.seaweed import StoreEndpoint

#: Headers that belong to one hop, not to the request (RFC 9110), plus those aiohttp recomputes.
HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "content-length"}
)
NOT_IMPLEMENTED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NotImplemented</Code>'
    b"<Message>A header you provided implies functionality that is not implemented"
    b"</Message></Error>"
)


class S3Proxy:
    """A proxy to ``upstream`` in ``mode`` ("overwrite" or "refuse"), started by ``start``."""

    def __init__(self, upstream: StoreEndpoint, mode: str) -> None:
        if mode not in ("overwrite", "refuse"):
            raise ValueError(f"mode {mode!r}: overwrite or refuse")
        self.upstream = upstream
        self.mode = mode
        self.port = 0
        self.requests: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def endpoint(self) -> StoreEndpoint:
        """The upstream's endpoint, reached through this proxy."""
        u = self.upstream
        return StoreEndpoint(
            f"http://127.0.0.1:{self.port}", u.bucket, u.access_key, u.secret_key, u.region
        )

    def start(self) -> StoreEndpoint:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self.endpoint

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _write_with_condition(self, request: web.Request) -> bool:
        if "If-None-Match" not in request.headers:
            return False
        query = request.rel_url.query
        is_put = request.method == "PUT" and "partNumber" not in query
        return is_put or (request.method == "POST" and "uploadId" in query)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        conditional = self._write_with_condition(request)
        self.requests[f"{request.method} conditional={conditional}"] += 1
        if self.mode == "refuse" and "If-None-Match" in request.headers:
            return web.Response(status=501, body=NOT_IMPLEMENTED, content_type="application/xml")
        if self.mode == "overwrite" and conditional:
            await self._delete(request.rel_url.raw_path)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        target = f"{self.upstream.endpoint_url}{request.rel_url.raw_path_qs}"
        assert self._session is not None
        async with self._session.request(
            request.method,
            aiohttp.client.URL(target, encoded=True),
            headers=headers,
            data=body if body else None,
            skip_auto_headers=("Content-Type",),
        ) as resp:
            data = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP}
            if request.method == "HEAD":  # no body: the object's length is the header's
                out["Content-Length"] = resp.headers.get("Content-Length", "0")
                return web.Response(status=resp.status, headers=out)
            return web.Response(status=resp.status, body=data, headers=out)

    async def _delete(self, raw_path: str) -> None:
        """Delete the object at ``raw_path`` (``/{bucket}/{key}``) with the store's credentials."""
        bucket, _, key = unquote(urlsplit(raw_path).path).lstrip("/").partition("/")
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, _delete_object, self.upstream, bucket, key)


def _delete_object(endpoint: StoreEndpoint, bucket: str, key: str) -> Any:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint.endpoint_url,
        aws_access_key_id=endpoint.access_key,
        aws_secret_access_key=endpoint.secret_key,
        region_name=endpoint.region,
    )
    return client.delete_object(Bucket=bucket, Key=key)
