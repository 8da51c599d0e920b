"""The ``Coordinator``: one running service's parts, as every route handler and task sees them.

``coordinator.app`` builds one per app and keeps it under the ``COORDINATOR`` key;
``coordinator.handlers`` reads it from the request. It also owns the long-polls waiting for a
round to close, what follows a close (wake them, count it, publish, prune), and what follows a
token revocation made by the operator's command (the member is out, the round stops waiting).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from aiohttp import web

from coordinator.checkpoints import CheckpointBook
from coordinator.config import CoordinatorConfig
from coordinator.machine import RoundMachine
from coordinator.metrics import CoordinatorMetrics
from coordinator.publisher import ManifestPublisher
from coordinator.retention import Retention
from coordinator.signing import ManifestSigner
from coordinator.storage import ObjectStore
from coordinator.tokens import TokenBook
from coordinator.verify import CheckpointVerifier
from protocol.messages import SignedManifest


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
    waiters: dict[int, asyncio.Event] = field(default_factory=dict)
    stopping: bool = False

    def after_close(self, closed: list[SignedManifest]) -> None:
        """Rounds closed: wake their long-polls, count them, publish their manifests, prune."""
        if not closed:
            return
        self.metrics.closed(closed)
        for signed in closed:
            event = self.waiters.pop(signed.manifest.round, None)
            if event is not None:
                event.set()
        self.publisher.kick()
        self.retention.kick()

    def apply_token_changes(self) -> None:
        """Take out every member whose token was revoked since the last call; note token use."""
        revoked = self.tokens.take_revoked()
        if revoked:
            self.after_close(self.machine.revoke(revoked))
        self.tokens.flush_used()

    async def wait_closed(self, round_: int, timeout: float) -> None:
        """Return when ``round_`` closes, the server stops, or after ``timeout`` seconds."""
        if self.stopping or timeout <= 0:
            return
        event = self.waiters.setdefault(round_, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)

    def release_waiters(self) -> None:
        """The server is stopping: answer every long-poll now, and any new one at once."""
        self.stopping = True
        for event in self.waiters.values():
            event.set()


COORDINATOR = web.AppKey("coordinator", Coordinator)
