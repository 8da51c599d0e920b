"""An in-memory object store behind the node's ``Transfers`` seam, and a clock to go with it.

``FakeStore`` keeps objects in a dict and hands out "presigned" URLs that are only tokens into
it: a PUT URL is bound to its key, size and sha256 and the key is write-once (a repeat of the
same bytes answers "already there", as S3's ``If-None-Match: *`` does), a GET URL names a key.
Each node gets its own ``Transfers`` view (``store.transfers(node_id)``), so a test can make the
GETs of one node fail (``failing_gets``) or hang (``blocked``) while its peers are fine. The file
transfers (``put_file``, ``get_to_file``) are the same PUT and GET with the bytes read from or
written to a local file (a download through a temporary name, as the real one), so a plan
applies to them alike.

``FakeClock`` is the daemon's and the coordinator's time: it moves only when a test calls
``advance``. A sleep ends when its time has come or when the clock is ``kick``-ed: the fake
coordinator kicks after every change of state, so a node polling a waiting round (or holding as
a straggler) looks again at once, as it would after its poll interval on a real clock.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from node.errors import DigestError, RetriesExhausted, TransferError
from protocol.parts import CompletedPart, MultipartGrant


class FakeClock:
    """Manual time: ``now`` moves by ``advance``; sleepers wake then, or on ``kick``."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.t = start
        self._changed = asyncio.Event()
        #: Lengths of the sleeps in progress (a test waits for a node to be asleep).
        self.sleeping: list[float] = []

    def now(self) -> float:
        return self.t

    def wall(self) -> float:
        """The same time, as the coordinator's wall clock."""
        return self.t

    async def sleep(self, seconds: float) -> None:
        until = self.t + seconds
        self.sleeping.append(seconds)
        try:
            changed = self._changed
            while self.t < until:
                await changed.wait()
                if self._changed is not changed:  # kicked or advanced: one look is enough
                    return
        finally:
            self.sleeping.remove(seconds)

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.kick()

    def kick(self) -> None:
        """Wake every sleeper (something changed that a poll would notice)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


@dataclass
class _Grant:
    key: str
    size: int
    sha256: str


@dataclass
class GetPlan:
    """How one node's GETs behave: keys in ``missing`` answer 404 at once; every other GET
    hangs while ``blocked`` is set to an unset event, then fails ``failing`` times first."""

    failing: int = 0
    missing: set[str] = field(default_factory=set)
    blocked: asyncio.Event | None = None
    calls: int = 0
    cancelled: int = 0


class FakeStore:
    """Objects by key; presigned URLs as tokens; per-node transfer views."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self._grants: dict[str, _Grant] = {}
        self._tokens = itertools.count()
        self.plans: dict[str, GetPlan] = {}
        #: Every PUT that reached the store: (node, key, bytes).
        self.puts: list[tuple[str, str, bytes]] = []
        #: While True the store does not answer: every transfer gives up as the real one would
        #: after its own retries (``RetriesExhausted``).
        self.down = False
        #: Transfers refused while down.
        self.refused = 0

    def check_up(self) -> None:
        if self.down:
            self.refused += 1
            raise RetriesExhausted("store: gave up after 6 attempts (fake outage)")

    def presign_put(self, key: str, size: int, sha256: str) -> str:
        url = f"mem://put/{next(self._tokens)}/{key}"
        self._grants[url] = _Grant(key, size, sha256)
        return url

    def presign_get(self, key: str) -> str:
        return f"mem://get/{key}"

    def matches(self, key: str, size: int, sha256: str) -> bool:
        """What the coordinator's HEAD check says about ``key``."""
        data = self.objects.get(key)
        return data is not None and len(data) == size and _sha(data) == sha256

    def delete_prefix(self, prefix: str) -> int:
        gone = [k for k in self.objects if k.startswith(prefix)]
        for key in gone:
            del self.objects[key]
        return len(gone)

    def transfers(self, node_id: str) -> NodeTransfers:
        return NodeTransfers(self, node_id, self.plans.setdefault(node_id, GetPlan()))


class NodeTransfers:
    """``node.daemon.api.Transfers`` for one node."""

    def __init__(self, store: FakeStore, node_id: str, plan: GetPlan) -> None:
        self.store = store
        self.node_id = node_id
        self.plan = plan

    async def put(self, url: str, headers: Mapping[str, str], data: bytes) -> bool:
        await asyncio.sleep(0)
        self.store.check_up()
        grant = self.store._grants.get(url)
        if grant is None:
            raise TransferError(f"upload: HTTP 403: unknown or expired URL {url}", 403)
        if len(data) != grant.size or _sha(data) != grant.sha256:
            raise TransferError("upload: HTTP 400: BadDigest", 400)
        self.store.puts.append((self.node_id, grant.key, data))
        if grant.key in self.store.objects:
            return False  # write-once: 412, the same bytes landed before
        self.store.objects[grant.key] = data
        return True

    async def put_parts(
        self, grant: MultipartGrant, data: bytes, done: dict[int, CompletedPart] | None = None
    ) -> list[CompletedPart]:
        raise TransferError("upload: this fake store has no multipart uploads", 501)

    async def get(self, url: str, *, size: int, sha256: str) -> bytes:
        plan = self.plan
        plan.calls += 1
        self.store.check_up()
        key = url.removeprefix("mem://get/")
        data = self.store.objects.get(key)
        if data is None or key in plan.missing:
            await asyncio.sleep(0)
            raise TransferError(f"download: HTTP 404: NoSuchKey {key}", 404)
        try:
            if plan.blocked is not None:
                await plan.blocked.wait()
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            plan.cancelled += 1
            raise
        if plan.failing > 0:
            plan.failing -= 1
            raise RetriesExhausted("download: gave up after 6 attempts (fake)")
        if len(data) != size or _sha(data) != sha256:
            raise DigestError(f"download: {key} does not match the manifest")
        return data

    async def put_file(
        self, url: str, headers: Mapping[str, str], path: Path, *, size: int
    ) -> bool:
        data = Path(path).read_bytes()
        if len(data) != size:
            raise TransferError(f"upload: {path} holds {len(data)} bytes, not {size}")
        return await self.put(url, headers, data)

    async def put_file_parts(
        self, grant: MultipartGrant, path: Path, *, size: int
    ) -> list[CompletedPart]:
        raise TransferError("upload: this fake store has no multipart uploads", 501)

    async def get_to_file(self, url: str, path: Path, *, size: int, sha256: str) -> None:
        data = await self.get(url, size=size, sha256=sha256)
        tmp = Path(path).with_name(f".{Path(path).name}.part")
        tmp.write_bytes(data)
        os.replace(tmp, path)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
