"""Retention: deleting from the object store what no node can need any more.

Two rules, as pure functions (``payload_rounds``, ``stale_checkpoints``) and one background task
(``Retention``) owned by the app that applies them after every round close and checkpoint commit,
once at start, and every ``RETRY_S`` seconds besides:

- the payloads of closed round r go once r is older than every verified checkpoint retention
  keeps (``replay_anchor``: the oldest of them) *and* more than ``retention_rounds`` rounds old.
  A joiner starts from the newest checkpoint and replays only the manifests after it; one that
  cannot use the newest (its download fails, its fingerprint does not check out) falls back to
  an older one of ``GET /v1/checkpoints`` and still finds every payload since. Without a
  verified checkpoint nothing goes: joiners replay from θ_0. Every checkpoint committed since
  the coordinator verifies them (``coordinator.store.verify``) is verified; one committed before (a
  database of schema version 2) is not relied on. Manifests stay: they are small and are the
  run's audit trail.
- checkpoints beyond the newest ``keep_checkpoints`` go (the model file and its sidecar), once
  their sidecar is published, so the publisher never writes a sidecar after its deletion; the
  newest verified one never goes, whatever ``keep_checkpoints`` says, since the payloads kept
  are exactly those needed to replay from it.

- multipart uploads under the run's folder started more than twice the presign expiry ago are
  aborted (``coordinator.store.multipart``): their grants are dead, and their parts would stay
  forever.

What was deleted is recorded (``meta.pruned_through``: every payload round up to it is gone;
``checkpoints.pruned``), so no round is listed twice, and counted in the same transaction
(``meta.deleted.payload``, ``meta.deleted.checkpoint``) for the metrics after a restart. Store
errors are logged and retried at the next wake; they never stop the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field

from coordinator.base.errors import TRANSIENT
from coordinator.monitoring.metrics import CoordinatorMetrics
from coordinator.state.db import CheckpointRow, Database
from coordinator.store.multipart import PartStore
from coordinator.store.object_store import ObjectStore, retry_logged
from protocol.keys import round_prefix, run_prefix, sidecar_key
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.coordinator.retention")

#: Seconds between passes when nothing wakes the task (also the retry delay after a failure).
RETRY_S = 60.0
#: Meta key: the newest round whose payloads are all deleted.
PRUNED_THROUGH = "pruned_through"


def payload_rounds(
    pruned_through: int, newest_checkpoint: int | None, current_round: int, retention: int
) -> range:
    """The rounds whose payloads may be deleted now and were not yet (in round order)."""
    if newest_checkpoint is None:
        return range(0)
    end = min(newest_checkpoint, current_round - retention)
    return range(pruned_through + 1, max(pruned_through + 1, end))


def newest_verified(rows: Sequence[CheckpointRow]) -> int | None:
    """The round of the newest verified checkpoint still in the store (``rows`` newest first)."""
    return next((r.info.round for r in rows if r.verified and not r.pruned), None)


def replay_anchor(rows: Sequence[CheckpointRow], keep: int) -> int | None:
    """The oldest verified checkpoint retention keeps (``rows`` newest first): payloads since it
    stay, so a node can start from any checkpoint it lists."""
    going = set(stale_checkpoints(rows, keep))
    kept = [r.info.round for r in rows if r.verified and not r.pruned and r.info.round not in going]
    return min(kept, default=None)


def stale_checkpoints(rows: Sequence[CheckpointRow], keep: int) -> list[int]:
    """Rounds of committed checkpoints to delete: not among the newest ``keep``, not the newest
    verified one, published, not yet deleted (``rows`` newest first, as
    ``Database.checkpoints`` lists them)."""
    anchor = newest_verified(rows)
    return [
        r.info.round for r in rows[keep:] if r.published and not r.pruned and r.info.round != anchor
    ]


@dataclass(eq=False)
class Retention:
    """The background task that applies the retention rules to one run's keys."""

    db: Database
    store: ObjectStore
    run: RunConfig
    _: KW_ONLY
    prefix: str
    current_round: Callable[[], int]
    metrics: CoordinatorMetrics | None = None
    parts: PartStore | None = None
    stale_upload_s: float = 1800.0
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    #: Set after each pass that finished without error.
    idle: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def kick(self) -> None:
        """A round closed or a checkpoint was committed: look again soon."""
        self._wake.set()

    def _count(self, kind: str, n: int) -> None:
        if self.metrics is not None and n:
            self.metrics.deleted.labels(kind=kind).inc(n)

    async def prune_once(self) -> int:
        """Apply both rules once; the number of objects deleted. Raises on a store failure
        (what was deleted before it stays recorded)."""
        deleted = 0
        done = int(self.db.get_meta(PRUNED_THROUGH) or -1)
        todo = payload_rounds(
            done,
            replay_anchor(self.db.checkpoints(), self.run.keep_checkpoints),
            self.current_round(),
            self.run.retention_rounds,
        )
        for round_ in todo:
            prefix = round_prefix(self.prefix, self.run.run_id, round_) + "payloads/"
            n = await self.store.delete_prefix(prefix)
            with self.db.tx():
                self.db.set_meta(PRUNED_THROUGH, str(round_))
                self.db.add_deleted("payload", n)
            self._count("payload", n)
            deleted += n
            log.info("event=pruned round=%d objects=%d", round_, n)
        rows = self.db.checkpoints()
        for round_ in stale_checkpoints(rows, self.run.keep_checkpoints):
            key = next(r.info.key for r in rows if r.info.round == round_)
            n = await self.store.delete_keys([key, sidecar_key(key)])
            with self.db.tx():
                self.db.mark_checkpoint(round_, pruned=True)
                self.db.add_deleted("checkpoint", n)
            self._count("checkpoint", n)
            deleted += n
            log.info("event=checkpoint_pruned round=%d objects=%d", round_, n)
        await self._abort_stale()
        return deleted

    async def _abort_stale(self) -> None:
        """Abort the uploads in parts nobody will complete (a crashed node, a fresh grant
        taken). Last, and never in the way of the rules above: a store that cannot list its
        uploads is told once per pass, at DEBUG while it is unreachable."""
        if self.parts is None:
            return
        try:
            await self.parts.abort_stale(
                run_prefix(self.prefix, self.run.run_id), self.stale_upload_s
            )
        except TRANSIENT as exc:
            retry_logged(log, "abort_stale_failed", RETRY_S, exc)

    async def run_forever(self) -> None:
        """Prune on start, on every kick and every ``RETRY_S`` seconds, until cancelled."""
        while True:
            self._wake.clear()
            self.idle.clear()
            try:
                await self.prune_once()
            except TRANSIENT as exc:
                retry_logged(log, "prune_failed", RETRY_S, exc)
            except Exception:  # a bug here must not take the coordinator down with it
                log.exception("event=prune_failed retry_in_s=%.0f", RETRY_S)
            else:
                self.idle.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RETRY_S)
