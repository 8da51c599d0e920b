"""Uploads closed rounds' signed manifests to the object store, retrying until it succeeds.

A round is closed (and answered to nodes over HTTP) the moment its transaction commits; the
copy in the object store follows. The publisher owns that step: woken after each close, it
uploads every closed round not yet marked published, in round order, with exponential backoff
and jitter on failure. At start it runs once, so manifests a crash left behind are published.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from botocore.exceptions import BotoCoreError, ClientError

from coordinator.db import Database
from coordinator.metrics import CoordinatorMetrics
from coordinator.storage import ObjectStore, StorageError
from protocol.keys import manifest_key

log = logging.getLogger("sparseloco.coordinator.publisher")

#: Backoff between failed attempts: first, cap (seconds).
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
#: Errors worth retrying: the store is down, slow or refusing for now.
TRANSIENT = (StorageError, ClientError, BotoCoreError, OSError)


class ManifestPublisher:
    def __init__(
        self,
        db: Database,
        store: ObjectStore,
        *,
        prefix: str,
        run_id: str,
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.db = db
        self.store = store
        self.prefix = prefix
        self.run_id = run_id
        self.metrics = metrics
        self._wake = asyncio.Event()
        self.published = asyncio.Event()  # set whenever nothing is left to publish

    def kick(self) -> None:
        """A round closed: publish soon."""
        self._wake.set()

    async def publish_pending(self) -> None:
        """Upload every unpublished manifest once; raises on the first failure."""
        for round_, body in self.db.unpublished():
            await self.store.put_bytes(
                manifest_key(self.prefix, self.run_id, round_), body.encode()
            )
            with self.db.tx():
                self.db.mark_published(round_)
            log.info("event=manifest_published round=%d", round_)

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
                log.warning("event=manifest_publish_failed retry_in_s=%.1f error=%s", wait, exc)
                delay = min(BACKOFF_MAX_S, delay * 2)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue
            delay = BACKOFF_FIRST_S
            self.published.set()
            await self._wake.wait()
