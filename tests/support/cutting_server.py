"""An HTTP object server that cuts bodies mid-way: the resets of a bad link, on loopback.

``CuttingServer`` serves one object (``GET`` with or without ``Range``, answering 206 with a
``Content-Range`` as S3 does) and takes uploads (``PUT``, answering an ``ETag``). It drops the
connection of chosen requests part way through their body, so unit tests can check that a
download resumes from the last byte it received (``node.daemon.ranged``) and that an upload
part is sent again alone (``node.daemon.multipart``), by counting the requests it saw.

``cut_gets``: how many GETs (in arrival order) are cut after ``cut_after`` bytes of body (with
``stall``, not cut but left hanging there, as a link that stops carrying anything: the client's
timeout ends the attempt);
``cut_puts``: which PUT paths have their first attempt cut after half the body arrived.
``ignore_range``: answer 200 with the whole object whatever the ``Range`` says (a broken store).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.test_utils import TestServer

#: Seconds a stalled body hangs (far longer than the tests' transfer timeouts).
STALL_S = 30.0


@dataclass
class Seen:
    """What the server was asked: every GET's ``Range`` (``""`` for none), every PUT's path."""

    ranges: list[str] = field(default_factory=list)
    puts: list[str] = field(default_factory=list)
    cut: int = 0


class CuttingServer:
    def __init__(
        self,
        body: bytes,
        *,
        cut_gets: int = 0,
        cut_after: int = 0,
        cut_puts: frozenset[str] = frozenset(),
        ignore_range: bool = False,
        stall: bool = False,
    ) -> None:
        self.body = body
        self.cut_gets = cut_gets
        self.cut_after = cut_after
        self.cut_puts = set(cut_puts)
        self.ignore_range = ignore_range
        self.stall = stall
        self.seen = Seen()
        #: Bodies of the PUTs that arrived whole, by path.
        self.stored: dict[str, bytes] = {}
        app = web.Application()
        app.router.add_get("/{name}", self._get)
        app.router.add_put("/{name}", self._put)
        self.server = TestServer(app)

    async def __aenter__(self) -> CuttingServer:
        await self.server.start_server()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close()

    def url(self, name: str = "object") -> str:
        return str(self.server.make_url(f"/{name}"))

    async def _get(self, request: web.Request) -> web.StreamResponse:
        wanted = request.headers.get("Range", "")
        self.seen.ranges.append(wanted)
        start, end = 0, len(self.body)
        status = 200
        headers = {}
        if wanted and not self.ignore_range:
            first, last = wanted.removeprefix("bytes=").split("-")
            start, end = int(first), min(len(self.body), int(last) + 1)  # as S3: to the end
            if start >= len(self.body):
                return web.Response(status=416)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(self.body)}"
        data = self.body[start:end]
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = len(data)
        await resp.prepare(request)
        if self.seen.cut < self.cut_gets and len(data) > self.cut_after:
            self.seen.cut += 1
            await resp.write(data[: self.cut_after])
            await resp.drain()
            if self.stall:
                await asyncio.sleep(STALL_S)  # the client gives up first
            assert request.transport is not None
            request.transport.abort()  # a reset: the client sees the body end early
            return resp
        await resp.write(data)
        await resp.write_eof()
        return resp

    async def _put(self, request: web.Request) -> web.Response:
        path = request.path
        self.seen.puts.append(path)
        size = int(request.headers["Content-Length"])
        if path in self.cut_puts:
            self.cut_puts.discard(path)
            self.seen.cut += 1
            await request.content.readexactly(size // 2)
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=500)  # never sent: the connection is gone
        data = await request.read()
        self.stored[path] = data
        return web.Response(headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})
