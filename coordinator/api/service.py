"""The ``Coordinator``: one running service's parts, as every route handler and task sees them.

``coordinator.api.app`` builds one per app and keeps it under the ``COORDINATOR`` key;
``coordinator.api.handlers`` reads it from the request. It also owns the long-polls (waiting for a
round to close, or for a waiting round to open; woken in batches, ``coordinator.api.wakeups``),
what follows a close (wake them, count it, publish, prune), what follows a token revocation
made by the operator's command (the member is out, the round stops waiting, its live figures
leave ``/metrics``), and the answer every node fetches after a close: the manifest with its
presigned download URLs, built once per round and served as the same bytes to every reader
until its URLs near half their lifetime (``manifest_body``).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from coordinator.api.wakeups import Wakeups
from coordinator.base.config import CoordinatorConfig
from coordinator.monitoring.metrics import CoordinatorMetrics
from coordinator.rules.checkpoints import CheckpointBook
from coordinator.rules.machine import RoundMachine
from coordinator.rules.payloadchecks import PartKeys
from coordinator.rules.tokens import TokenBook
from coordinator.state.durability import GroupSync
from coordinator.state.signing import ManifestSigner
from coordinator.store.datasets import DatasetBook
from coordinator.store.multipart import PartStore
from coordinator.store.object_store import ObjectStore
from coordinator.store.publisher import ManifestPublisher
from coordinator.store.retention import Retention
from coordinator.store.storewatch import StoreWatch
from coordinator.store.verify import CheckpointVerifier
from protocol.messages import ManifestView, RoundState, SignedManifest

#: Rounds whose manifest answer is kept (the newest; catching-up nodes read older ones once).
CACHED_MANIFESTS = 8
#: A cached manifest answer is rebuilt once this share of its URLs' lifetime has passed, so every
#: URL handed out is valid for at least the rest (a node may retry its downloads with them).
URL_REUSE_SHARE = 0.5


@dataclass
class Coordinator:
    """Everything the handlers share; one per app."""

    config: CoordinatorConfig
    machine: RoundMachine
    checkpoints: CheckpointBook
    store: ObjectStore
    signer: ManifestSigner
    metrics: CoordinatorMetrics
    publisher: ManifestPublisher
    retention: Retention
    tokens: TokenBook
    verifier: CheckpointVerifier
    #: The run's prepared dataset (``RunConfig.dataset``), if it names one.
    datasets: DatasetBook
    #: Group commit of the database; ``None`` when every commit syncs itself (tests).
    sync: GroupSync | None = None
    #: Whether the store answers (``store`` reports to it); ``None``: not watched.
    storewatch: StoreWatch | None = None
    #: Multipart uploads (``coordinator.store.multipart``); ``None``: every grant is a single PUT.
    parts: PartStore | None = None
    #: The key of each multipart upload of a payload granted by this process.
    part_keys: PartKeys = field(default_factory=PartKeys)
    #: Long-polls of a round's manifest, by round, released when it closes.
    waiters: Wakeups = field(default_factory=Wakeups)
    #: Long-polls of a waiting round, by round, released when it opens (or is no longer newest).
    open_waiters: Wakeups = field(default_factory=Wakeups)
    stopping: bool = False
    #: Set when a close waits for submissions to be confirmed (``coordinator.api.confirm``).
    confirm_kick: asyncio.Event = field(default_factory=asyncio.Event)
    #: round -> (the manifest answer's bytes, until when (monotonic) they may be served)
    manifests: OrderedDict[int, tuple[bytes, float]] = field(default_factory=OrderedDict)

    async def durable(self) -> None:
        """Return once everything committed so far is on disk (``GroupSync.barrier``)."""
        if self.sync is not None and self.sync.pending():
            await self.sync.barrier()

    def manifest_body(self, round_: int) -> bytes | None:
        """The ``ManifestView`` of closed ``round_`` as JSON bytes, ``None`` while it is open.

        Every reader gets the same bytes: the download URLs are presigned once per round, not
        once per request, and rebuilt when ``URL_REUSE_SHARE`` of their lifetime is gone.
        """
        now = time.monotonic()
        cached = self.manifests.get(round_)
        if cached is not None and now < cached[1]:
            return cached[0]
        signed = self.machine.manifest(round_)
        if signed is None:
            return None
        urls = {e.node_id: self.store.presign_get(e.key) for e in signed.manifest.gather}
        body = ManifestView(signed=signed, urls=urls).model_dump_json().encode()
        fresh_for = URL_REUSE_SHARE * self.config.server.presign_expiry_s
        self.manifests[round_] = (body, now + fresh_for)
        self.manifests.move_to_end(round_)
        while len(self.manifests) > CACHED_MANIFESTS:
            self.manifests.popitem(last=False)
        return body

    def after_close(self, closed: list[SignedManifest]) -> None:
        """After a call that may close rounds: a close that waits for submissions to be
        confirmed gets them confirmed; rounds closed: wake their long-polls, count them,
        publish their manifests, prune."""
        if self.machine.checks.wanted:
            self.confirm_kick.set()
        if not closed:
            return
        self.metrics.closed(closed)
        for signed in closed:
            self.waiters.release(signed.manifest.round)
        self.wake_opened()
        self.publisher.kick()
        self.retention.kick()

    def apply_token_changes(self) -> None:
        """Take out every member whose token was revoked since the last call (and its live
        figures off ``/metrics``); note token use."""
        revoked = self.tokens.take_revoked()
        if revoked:
            self.metrics.nodes.forget(revoked)
            self.after_close(self.machine.revoke(revoked))
        self.tokens.flush_used()

    async def wait_closed(self, round_: int, timeout: float) -> None:
        """Return when ``round_`` closes, the server stops, or after ``timeout`` seconds."""
        if not self.stopping:
            await self.waiters.wait(round_, timeout)

    async def wait_opened(self, round_: int, timeout: float) -> None:
        """Return when waiting round ``round_`` opens, the server stops, or after ``timeout``."""
        if not self.stopping:
            await self.open_waiters.wait(round_, timeout)

    def wake_opened(self) -> None:
        """Release the long-polls of rounds that are no longer waiting (call after any change
        that may open a round: a join, a tick, a close)."""
        rounds = self.open_waiters.keys()
        if not rounds:
            return
        number = self.machine.round_number()
        waiting = self.machine.round_view_state() == RoundState.WAITING
        for round_ in rounds:
            if round_ != number or not waiting:
                self.open_waiters.release(round_)

    def release_waiters(self) -> None:
        """The server is stopping: answer every long-poll now, and any new one at once."""
        self.stopping = True
        self.waiters.release_all()
        self.open_waiters.release_all()


COORDINATOR = web.AppKey("coordinator", Coordinator)
