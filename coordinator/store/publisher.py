"""Uploads what the database decided to the object store, retrying until it succeeds.

A round is closed (and answered to nodes over HTTP) the moment its transaction commits; the
copy of its signed manifest in the object store follows. Likewise a committed checkpoint gets its
``.json`` sidecar and, if it is the newest, ``checkpoints/latest.json``. The publisher owns that
step: woken after each close or commit, it uploads every closed round and every committed
checkpoint not yet marked published, in round order, with exponential backoff and jitter on
failure. At start it runs once, so whatever a crash left behind is published.

``latest.json`` only moves forward: it is rewritten when the newest committed checkpoint is newer
than the one it last named (``meta.latest_published``), and checkpoint publication runs under a
lock, so two commits racing cannot leave it naming the older one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import KW_ONLY, dataclass, field

from coordinator.base.errors import TRANSIENT
from coordinator.monitoring.metrics import CoordinatorMetrics
from coordinator.state.db import Database
from coordinator.store.object_store import ObjectStore, retry_logged
from protocol.keys import latest_checkpoint_key, manifest_key, sidecar_key

log = logging.getLogger("sparseloco.coordinator.publisher")

#: Backoff between failed attempts: first, cap (seconds).
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0


@dataclass(eq=False)
class ManifestPublisher:
    """The background task that publishes one run's closed rounds and committed checkpoints."""

    db: Database
    store: ObjectStore
    _: KW_ONLY
    prefix: str
    run_id: str
    metrics: CoordinatorMetrics | None = None
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    _checkpoint_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    #: Set whenever nothing is left to publish.
    published: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def kick(self) -> None:
        """A round closed or a checkpoint was committed: publish soon."""
        self._wake.set()

    async def publish_pending(self) -> None:
        """Upload every unpublished manifest and checkpoint once; raises on the first failure."""
        for round_, body in self.db.unpublished():
            await self.store.put_bytes(
                manifest_key(self.prefix, self.run_id, round_), body.encode()
            )
            with self.db.tx():
                self.db.mark_published(round_)
            log.info("event=manifest_published round=%d", round_)
        await self.publish_checkpoints()

    async def publish_checkpoints(self) -> None:
        """Write the sidecar of every unpublished checkpoint, then move ``latest.json`` forward."""
        async with self._checkpoint_lock:
            for row in reversed(self.db.checkpoints()):
                if row.published or row.pruned:
                    continue
                body = row.info.model_dump_json().encode()
                await self.store.put_bytes(sidecar_key(row.info.key), body)
                with self.db.tx():
                    self.db.mark_checkpoint(row.info.round, published=True)
                log.info("event=checkpoint_sidecar_published round=%d", row.info.round)
            newest = self.db.newest_checkpoint()
            done = int(self.db.get_meta("latest_published") or -1)
            if newest is None or newest.round <= done:
                return
            key = latest_checkpoint_key(self.prefix, self.run_id)
            await self.store.put_bytes(key, newest.model_dump_json().encode())
            with self.db.tx():
                self.db.set_meta("latest_published", str(newest.round))
            log.info("event=latest_checkpoint_published round=%d", newest.round)

    async def run(self) -> None:
        """Publish forever (until cancelled): on start, after every kick, retrying failures."""
        delay = BACKOFF_FIRST_S
        while True:
            self._wake.clear()
            self.published.clear()
            try:
                await self.publish_pending()
            except TRANSIENT as exc:
                if self.metrics is not None:
                    self.metrics.publish_failures.inc()
                wait = min(BACKOFF_MAX_S, delay) * (0.5 + random.random())
                retry_logged(log, "manifest_publish_failed", wait, exc)
                delay = min(BACKOFF_MAX_S, delay * 2)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue
            delay = BACKOFF_FIRST_S
            self.published.set()
            await self._wake.wait()
