"""Checkpoints from the node's side: offering θ every K rounds, and starting from the newest.

- ``offer``: after applying round R-1 (so the model holds θ_R) with R a multiple of the run's
  ``checkpoint_every``, the node's ranks write θ into one safetensors file in the state dir
  (``node.compute.checkpoint``: each rank its own tensors) and rank 0 asks the coordinator for
  a presigned PUT and uploads the file from disk (a file of ``multipart.MULTIPART_THRESHOLD``
  bytes or more in parts, each read from disk and retried alone, then completed by the
  coordinator, which verifies the file before it commits it). The first node whose reported
  fingerprint matches the majority gets it; every other node hears ``not_needed`` and carries
  on. Failures cost the checkpoint, never the round.
- ``restore_latest``: a node with no usable local state (a new joiner, a wiped disk, a torn
  state file) or a node that diverged downloads the newest checkpoint to a file (size and
  sha256 checked as it lands), every rank checks the header and reads its own tensors, the
  fingerprint of them all must be the agreed one, and the node continues from that round;
  replaying the manifests since then is the round loop's ordinary catch-up. One that fails its
  checks falls back to the next older one (``GET /v1/checkpoints``), then to θ_0. A store that
  does not answer says nothing about the checkpoint: the node waits for it (the store's link
  logs the outage once) and asks again with fresh URLs, until a stop request (``Abandoned``).

No process holds the whole model on either way: the file is written, hashed, uploaded and
downloaded a chunk at a time, and read a tensor at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from node.compute.worker import Worker
from node.daemon import multipart
from node.daemon.api import CoordinatorApi, Transfers
from node.daemon.retry import Backoff
from node.errors import (
    Abandoned,
    CheckpointError,
    CoordinatorError,
    DigestError,
    RetriesExhausted,
    TransferError,
)
from protocol.causes import cause
from protocol.messages import CheckpointInfo, CheckpointUpload, UploadGrant
from protocol.parts import UploadComplete

log = logging.getLogger("sparseloco.checkpoints")

T = TypeVar("T")
Compute = Callable[..., Awaitable[Any]]


#: Checkpoints tried, newest first, before a node falls back to θ_0 and the full replay.
MAX_TRIED = 3


@dataclass(eq=False)
class CheckpointSync:
    """Checkpoint traffic for one node.

    ``node``: the node's compute (``node.daemon.ops.NodeCompute``), which runs CPU work on the
    node's compute thread; checkpoint files pass through ``state_dir``; ``sleep`` pauses while
    the store is away, ``stopped`` says a stop was requested (the pause then ends the wait).
    """

    api: CoordinatorApi
    transfers: Transfers
    node: Compute
    state_dir: Path
    _: KW_ONLY
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    stopped: Callable[[], bool] = lambda: False
    #: Why the newest checkpoint was rejected at the last ``restore_latest``; None if it was
    #: not (the daemon names it when it gives up resynchronising).
    rejected: str | None = field(default=None, init=False)

    async def offer(self, worker: Worker) -> CheckpointInfo | None:
        """Offer θ_{worker.round} if this round is a checkpoint round; the accepted info."""
        every = worker.run.checkpoint_every
        r = worker.round
        if not every or r == 0 or r % every:
            return None
        path = self.state_dir / "checkpoint-upload.safetensors"
        try:
            size, sha256, fp = await self.node("write_checkpoint", str(path))
            plan = None  # one PUT
            if size >= multipart.MULTIPART_THRESHOLD:
                plan = await asyncio.to_thread(multipart.file_part_plan, path, size)
            offer = CheckpointUpload(size=size, sha256=sha256, fingerprint=fp, parts=plan)
            try:
                grant = await self.api.checkpoint_grant(r, offer)
            except CoordinatorError as exc:
                log.info(
                    "event=checkpoint_declined node=%s round=%d why=%s",
                    worker.node_id, r, exc.error,
                )  # fmt: skip
                return None
            try:
                await self._upload(r, grant, path, size)
                info = await self.api.checkpoint_commit(r, offer)
            except RetriesExhausted as exc:  # the checkpoint is fine: the store did not answer
                log.info(
                    "event=checkpoint_not_uploaded node=%s round=%d why=store_unreachable"
                    " cause=%r (the run keeps the previous checkpoint)",
                    worker.node_id, r, cause(exc),
                )  # fmt: skip
                log.debug("event=checkpoint_not_uploaded error=%r", exc)
                return None
            except (CoordinatorError, TransferError) as exc:
                log.warning(
                    "event=checkpoint_failed node=%s round=%d cause=%r",
                    worker.node_id, r, cause(exc),
                )  # fmt: skip
                log.debug("event=checkpoint_failed error=%r", exc)
                return None
        finally:
            path.unlink(missing_ok=True)
        log.info(
            "event=checkpoint_uploaded node=%s round=%d bytes=%d fingerprint=%s",
            worker.node_id,
            r,
            size,
            fp,
        )
        return info

    async def _upload(self, round_: int, grant: UploadGrant, path: Path, size: int) -> None:
        """The file through ``grant``: one PUT, or every part and then the completion."""
        if grant.multipart is None:
            await self.transfers.put_file(grant.url, grant.headers, path, size=size)
            return
        parts = await self.transfers.put_file_parts(grant.multipart, path, size=size)
        done = UploadComplete(upload_id=grant.multipart.upload_id, parts=parts)
        await self.api.checkpoint_complete(round_, done)

    async def restore_latest(self, worker: Worker) -> CheckpointInfo | None:
        """Load the newest usable checkpoint into ``worker``; None (θ untouched) if there is
        none or every one fails verification.

        The coordinator verified each before committing it, so a bad one means the store's
        object changed since (someone with store credentials, or a broken store). The node then
        falls back to the next older one: retention keeps every payload since the oldest
        checkpoint it keeps, so the replay from there still finds what it needs.
        """
        self.rejected = None
        backoff = Backoff()
        waiting = False
        while True:
            try:
                return await self._restore_newest(worker)
            except RetriesExhausted as exc:
                if not waiting:
                    log.info(
                        "event=checkpoint_waiting node=%s why=store_unreachable cause=%r"
                        " (not the checkpoint's fault; retrying)",
                        worker.node_id, cause(exc),
                    )  # fmt: skip
                    waiting = True
                log.debug("event=checkpoint_waiting error=%r", exc)
                await self.sleep(backoff.next())
                if self.stopped():
                    raise Abandoned() from exc

    async def _restore_newest(self, worker: Worker) -> CheckpointInfo | None:
        """One pass over the newest checkpoints; ``RetriesExhausted`` if the store is away."""
        views = await self.api.checkpoints()
        path = self.state_dir / "checkpoint-download.safetensors"
        for view in views[:MAX_TRIED]:
            info = view.info
            try:
                await self.transfers.get_to_file(view.url, path, size=info.size, sha256=info.sha256)
                await self.node("load_checkpoint", str(path), info.round, info.fingerprint)
            except (TransferError, CheckpointError) as exc:
                self.rejected = self.rejected or f"round {info.round}: {exc}"
                why = "failed_verification" if _bad_bytes(exc) else "refused_by_store"
                log.warning(
                    "event=checkpoint_rejected node=%s round=%d why=%s cause=%r",
                    worker.node_id,
                    info.round,
                    why,
                    cause(exc),
                )
                log.debug("event=checkpoint_rejected error=%r", exc)
                continue
            finally:
                path.unlink(missing_ok=True)
            log.info(
                "event=checkpoint_loaded node=%s round=%d bytes=%d",
                worker.node_id,
                info.round,
                info.size,
            )
            return info
        return None


def _bad_bytes(exc: Exception) -> bool:
    """The checkpoint's bytes or contents are wrong (not: the store refused to hand them)."""
    return isinstance(exc, (DigestError, CheckpointError))
