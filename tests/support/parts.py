"""Helpers of the multipart tests (``test_multipart.py``, ``test_multipart_store.py``).

- ``small_parts``: the node's threshold and part size lowered to S3's smallest part (5 MiB),
  so a payload of 11-12 MiB goes in three parts;
- ``open_run``: a coordinator (``make_api``) whose run has one member, ``n0``, joined, and
  ``node_client``: that node's own ``CoordinatorClient``;
- ``CountingSession``: a session that counts part uploads by number and cuts chosen ones half
  way through their body.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from node.daemon import multipart
from node.daemon.client import CoordinatorClient
from node.daemon.retry import RetryPolicy
from protocol.runconfig import RunConfig
from support.api import Api, ApiFactory, token

#: Few and quick retries: a test's faults are exact, not waited out.
FAST = RetryPolicy(attempts=3, base_s=0.01, budget_s=20.0)
#: S3's smallest part.
PART = 5 << 20


def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Objects of two parts or more go in parts of ``PART`` bytes."""
    monkeypatch.setattr(multipart, "MULTIPART_THRESHOLD", 2 * PART)
    monkeypatch.setattr(multipart, "UPLOAD_PART_SIZE", PART)


async def open_run(make_api: ApiFactory) -> Api:
    """A coordinator whose round 0 is open, with ``n0`` its one member."""
    api = await make_api(RunConfig(name="multipart", min_nodes=1, gather_size=4, rounds=3))
    status, _ = await api.call("POST", "/v1/join", "n0", {})
    assert status == 200
    return api


def node_client(api: Api, http: aiohttp.ClientSession) -> CoordinatorClient:
    return CoordinatorClient(http, str(api.client.make_url("")), token("n0"), policy=FAST)


class CountingSession:
    """A session that counts PUTs by part number and cuts the first ``cuts`` attempts of
    ``victim`` half way through their body (the connection drops while the store reads it)."""

    def __init__(
        self, http: aiohttp.ClientSession, victim: int | None = None, cuts: int = 1
    ) -> None:
        self.http = http
        self.victim = victim
        self.cuts = cuts
        self.puts: Counter[int] = Counter()

    def put(self, url: Any, *, data: Any, headers: dict[str, str], **kw: Any) -> Any:
        number = int(str(url).split("partNumber=")[1].split("&")[0])
        self.puts[number] += 1
        if number == self.victim and self.puts[number] <= self.cuts:
            data = _cut(data, int(headers["Content-Length"]) // 2)
        return self.http.put(url, data=data, headers=headers, **kw)


async def _cut(body: AsyncIterator[bytes], after: int) -> AsyncIterator[bytes]:
    """``body`` until ``after`` bytes went out, then the connection drops."""
    sent = 0
    async for piece in body:
        yield piece
        sent += len(piece)
        if sent >= after:
            await asyncio.sleep(0.05)
            raise ConnectionResetError("the link dropped mid-part")
