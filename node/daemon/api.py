"""The daemon's seams: what it needs from the coordinator, the object store and the clock.

``NodeDaemon`` talks to the outside world only through these three small Protocols, built in
``node.daemon.serve.run_node``:

- ``CoordinatorApi``: one coroutine per endpoint the node calls (``node.daemon.client``
  implements it over HTTP, with retries);
- ``Transfers``: a PUT (or an upload in parts) to and a verified GET from presigned URLs, from
  bytes in memory or a local file (``node.daemon.transfer`` implements it with aiohttp);
- ``Clock``: the daemon's own pauses (polling a waiting round, heartbeats, an injected slow
  fault) and timestamps, so a test can drive time by hand.

The unit tests drive the real daemon against in-memory fakes of all three
(``tests/support/fake_coordinator.py``, ``tests/support/fake_store.py``): no process, no socket.
Errors follow ``node.errors``: a refusal is ``CoordinatorError``, a transfer that cannot succeed
is ``TransferError``, a transient failure that outlived its retries is ``RetriesExhausted``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from protocol.dataset import DatasetFiles, DatasetView
from protocol.messages import (
    CheckpointInfo,
    CheckpointUpload,
    CheckpointView,
    JoinResponse,
    ManifestView,
    NodeCondition,
    RoundView,
    SubmitRequest,
    SubmitResponse,
    UploadGrant,
)
from protocol.parts import CompletedPart, MultipartGrant, PartPlan, UploadComplete, UploadDone
from protocol.reports import RoundReport


@dataclass(frozen=True)
class Heard:
    """Requests as heartbeats: the condition the latest request said (the coordinator takes
    it as the request arrives, so a long-poll in flight has said it), and how long ago the
    last answer the coordinator counted as a heartbeat came."""

    condition: NodeCondition
    age_s: float


class CoordinatorApi(Protocol):
    """The coordinator as one node sees it (``protocol.routes`` lists the endpoints)."""

    async def join(self, client: str = "") -> JoinResponse: ...

    async def heartbeat(self, condition: NodeCondition | None = None) -> RoundView:
        """Stay a member, saying what the node is doing (``NodeCondition``)."""
        ...

    def say(self, condition: Callable[[], NodeCondition]) -> None:
        """Carry ``condition()`` on every request from now on, so that a request the
        coordinator counts as a heartbeat tells it what the node is doing."""
        ...

    def heard(self) -> Heard | None:
        """The last request the coordinator counted as a heartbeat (its condition, its age);
        None if none did: the daemon then beats at every interval."""
        ...

    async def leave(self) -> None: ...

    async def round(self) -> RoundView: ...

    async def upload_grant(
        self, round_: int, size: int, sha256: str, parts: PartPlan | None = None
    ) -> UploadGrant:
        """A presigned PUT of the payload, or with ``parts`` a multipart upload (if granted)."""
        ...

    async def upload_complete(self, round_: int, request: UploadComplete) -> UploadDone:
        """Complete the payload's multipart upload, write-once (``protocol.parts``)."""
        ...

    async def submit(self, round_: int, request: SubmitRequest) -> SubmitResponse: ...

    async def manifest(self, round_: int) -> ManifestView | RoundView:
        """The closed round's manifest, or the open round's view after a bounded wait."""
        ...

    async def report(self, round_: int, report: RoundReport) -> None: ...

    async def checkpoint_grant(self, round_: int, offer: CheckpointUpload) -> UploadGrant: ...

    async def checkpoint_complete(self, round_: int, request: UploadComplete) -> UploadDone:
        """Complete the checkpoint's multipart upload, write-once (grant holder only)."""
        ...

    async def checkpoint_commit(self, round_: int, offer: CheckpointUpload) -> CheckpointInfo: ...

    async def checkpoints(self) -> list[CheckpointView]:
        """Every committed checkpoint still in the store with a presigned GET, newest first."""
        ...

    async def dataset(self) -> DatasetView:
        """The run's prepared dataset (``RunConfig.dataset``): a presigned GET of its manifest."""
        ...

    async def dataset_files(self, names: list[str]) -> DatasetFiles:
        """Presigned GETs for files the dataset's manifest lists."""
        ...


class Transfers(Protocol):
    """Bulk bytes through presigned URLs: the node's whole view of the object store."""

    async def put(self, url: str, headers: Mapping[str, str], data: bytes) -> bool:
        """Upload ``data`` with exactly ``headers``; False if the write-once key already held it."""
        ...

    async def put_parts(
        self, grant: MultipartGrant, data: bytes, done: dict[int, CompletedPart] | None = None
    ) -> list[CompletedPart]:
        """Upload ``data`` through a multipart grant's part URLs, each part retried alone; the
        parts the store took, for the completion. Parts in ``done`` (by number) are not sent
        again, and every part the store takes is added to it."""
        ...

    async def get(self, url: str, *, size: int, sha256: str) -> bytes:
        """Download and verify an object of known size and sha256 (``DigestError`` if not)."""
        ...

    async def put_file(
        self, url: str, headers: Mapping[str, str], path: Path, *, size: int
    ) -> bool:
        """Upload the ``size`` bytes of the file at ``path``, streamed from disk, with exactly
        ``headers``; False if the write-once key already held it."""
        ...

    async def put_file_parts(
        self, grant: MultipartGrant, path: Path, *, size: int
    ) -> list[CompletedPart]:
        """``put_parts`` of the ``size`` bytes of the file at ``path``, streamed from disk."""
        ...

    async def get_to_file(self, url: str, path: Path, *, size: int, sha256: str) -> None:
        """Download an object of known size and sha256 to ``path`` without holding it in
        memory; ``path`` appears only once it checks out (``DigestError`` if not, and no file)."""
        ...


class Clock(Protocol):
    """Time as the daemon uses it."""

    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class RealClock:
    """``time.monotonic`` and ``asyncio.sleep``."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
