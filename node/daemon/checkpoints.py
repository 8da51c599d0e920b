"""Checkpoints from the node's side: offering θ every K rounds, and starting from the newest.

- ``offer``: after applying round R-1 (so the model holds θ_R) with R a multiple of the run's
  ``checkpoint_every``, a node serialises θ as safetensors and asks the coordinator for a
  presigned PUT. The first node whose reported fingerprint matches the majority gets it; every
  other node hears ``not_needed`` and carries on. Failures cost the checkpoint, never the round.
- ``restore_latest``: a node with no usable local state (a new joiner, a wiped disk, a torn
  state file) or a node that diverged downloads the newest checkpoint, checks its sha256 and
  the fingerprint of the parameters it holds, and continues from that round; replaying the
  manifests since then is the round loop's ordinary catch-up. One that fails its checks falls
  back to the next older one (``GET /v1/checkpoints``), then to θ_0.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from node.compute.worker import Worker
from node.daemon.api import CoordinatorApi, Transfers
from node.errors import CheckpointError, CoordinatorError, RetriesExhausted, TransferError
from protocol.messages import CheckpointInfo, CheckpointUpload

log = logging.getLogger("sparseloco.checkpoints")

T = TypeVar("T")
Compute = Callable[..., Awaitable[Any]]


#: Checkpoints tried, newest first, before a node falls back to θ_0 and the full replay.
MAX_TRIED = 3


class CheckpointSync:
    """Checkpoint traffic for one node; ``compute`` runs CPU work on the node's compute thread."""

    def __init__(self, api: CoordinatorApi, transfers: Transfers, compute: Compute) -> None:
        self.api = api
        self.transfers = transfers
        self.compute = compute
        #: Why the newest checkpoint was rejected at the last ``restore_latest``; None if it was
        #: not (the daemon names it when it gives up resynchronising).
        self.rejected: str | None = None

    async def offer(self, worker: Worker) -> CheckpointInfo | None:
        """Offer θ_{worker.round} if this round is a checkpoint round; the accepted info."""
        every = worker.run.checkpoint_every
        r = worker.round
        if not every or r == 0 or r % every:
            return None
        data, sha256, fp = await self.compute(worker.checkpoint_bytes)
        offer = CheckpointUpload(size=len(data), sha256=sha256, fingerprint=fp)
        try:
            grant = await self.api.checkpoint_grant(r, offer)
        except CoordinatorError as exc:
            log.info(
                "event=checkpoint_declined node=%s round=%d why=%s", worker.node_id, r, exc.error
            )
            return None
        try:
            await self.transfers.put(grant.url, grant.headers, data)
            info = await self.api.checkpoint_commit(r, offer)
        except (CoordinatorError, TransferError, RetriesExhausted) as exc:
            log.warning("event=checkpoint_failed node=%s round=%d error=%r", worker.node_id, r, exc)
            return None
        log.info(
            "event=checkpoint_uploaded node=%s round=%d bytes=%d fingerprint=%s",
            worker.node_id,
            r,
            len(data),
            fp,
        )
        return info

    async def restore_latest(self, worker: Worker) -> CheckpointInfo | None:
        """Load the newest usable checkpoint into ``worker``; None (θ untouched) if there is
        none or every one fails verification.

        The coordinator verified each before committing it, so a bad one means the store's
        object changed since (someone with store credentials, or a broken store). The node then
        falls back to the next older one: retention keeps every payload since the oldest
        checkpoint it keeps, so the replay from there still finds what it needs.
        """
        self.rejected = None
        views = await self.api.checkpoints()
        for view in views[:MAX_TRIED]:
            info = view.info
            try:
                data = await self.transfers.get(view.url, size=info.size, sha256=info.sha256)
                load = partial(worker.load_checkpoint, round_=info.round, expected=info.fingerprint)
                await self.compute(load, data)
            except (TransferError, RetriesExhausted, CheckpointError) as exc:
                self.rejected = self.rejected or f"round {info.round}: {exc}"
                log.warning(
                    "event=checkpoint_rejected node=%s round=%d error=%r",
                    worker.node_id,
                    info.round,
                    exc,
                )
                continue
            log.info(
                "event=checkpoint_loaded node=%s round=%d bytes=%d",
                worker.node_id,
                info.round,
                info.size,
            )
            return info
        return None
