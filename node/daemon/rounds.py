"""Finishing a round on a node: DESIGN.md's steps 6-9, one named step each.

``RoundFinisher.finish(r)`` runs for every round the node applies, whether it took part
(the daemon's pending round is r) or only catches up:

1. ``wait``: the signed manifest of r (a stop request ends the wait);
2. ``verify``: its signature, run and round (``protocol.signing``);
3. ``diverged``: θ's fingerprint against the manifest's base; a mismatch means resync;
4. ``download``: the whole gather set or nothing; while the store does not answer, the node
   waits and fetches the manifest again for fresh URLs, however long that takes; 404
   (retention pruned the round) means the node is further behind than replay reaches and
   skips to the newest checkpoint;
5. ``decode``: validate every payload (lazily: checked now, decoded once while aggregating);
6. ``apply``: screen the peers (``node.compute.robust``), aggregate the rest in node-id order
   and apply (plus the chaos suite's faults); who was screened out goes into the report;
7. ``settle``: the own contribution: counted as sent if aggregated, else ĉ back into e
   (step 9), and the error-feedback account computed = sent + held;
8. ``save``: held-out loss on the run's schedule (``RunConfig.evaluates``), the fingerprint of
   θ_{r+1}, and the state on disk only if the node did not train this round or the run ends
   (after training, the state saved then is enough to finish this round again:
   ``node.compute.state``);
9. ``report``: fingerprint, losses, bytes, timings and mass to the coordinator; then offer a
   checkpoint if r+1 is a checkpoint round.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from pydantic import ValidationError

from node.daemon.gather import Blobs, fetch_gather
from node.daemon.host import RoundDaemon
from node.daemon.pending import PendingRound
from node.daemon.retry import Backoff
from node.daemon.upload import submit
from node.errors import CoordinatorError, RetriesExhausted, TransferError
from protocol.causes import cause
from protocol.messages import Manifest, ManifestView, RoundState, RoundView
from protocol.reports import Mass, RoundReport
from protocol.signing import verify_manifest

log = logging.getLogger("sparseloco.node")

#: Attempts at a gather set that answer 404 (each with fresh URLs) before the round counts as
#: pruned by retention.
MISSING_ATTEMPTS = 3

Rejected = dict[str, str]


@dataclass
class Gathered:
    """A closed round's verified manifest and its downloaded gather set."""

    manifest: Manifest
    blobs: Blobs
    #: Payloads left out already (a digest that does not match), with the reason.
    rejected: Rejected
    download_s: float


class RoundFinisher:
    """The steps after training, for one daemon (its seams, worker and pending round)."""

    def __init__(self, daemon: RoundDaemon) -> None:
        self.d = daemon

    async def finish(self, r: int) -> None:
        """Apply round r (steps 6-9); returns early on a stop, a resync or a skip."""
        d = self.d
        pending = d.pending if d.pending is not None and d.pending.round == r else None
        view = await self.wait(r)
        if view is None:
            return
        self.waited(pending)
        manifest = self.verify(view, r)
        if await self.diverged(r, manifest):
            await d.resync()
            return
        t0 = time.perf_counter()
        fetched = await self.download(r, view, manifest, pending)
        if fetched is None:
            return
        await self.conclude(r, Gathered(manifest, *fetched, time.perf_counter() - t0))

    def waited(self, pending: PendingRound | None) -> None:
        """The manifest is here: the seconds since the own submit (the round's ``wait``)."""
        if pending is not None and pending.submitted_at is not None:
            pending.timings["wait"] = self.d.clock.now() - pending.submitted_at

    async def conclude(
        self, r: int, gathered: Gathered, merged: tuple[Rejected, Rejected] | None = None
    ) -> None:
        """Steps 5-9 once round r's gather set is here: decode, apply, settle, save, report.
        ``merged``: steps 5-6 were taken already, during the next round's training (overlap
        "merge", ``node.daemon.merge``): the payloads that failed validation and the screened."""
        d = self.d
        pending = d.pending if d.pending is not None and d.pending.round == r else None
        manifest, blobs, rejected = gathered.manifest, gathered.blobs, gathered.rejected
        t1 = time.perf_counter()
        if merged is None:
            invalid: Rejected = await d.node("read_gather", r, blobs, claims=manifest.steps())
            t2 = time.perf_counter()
            screened = await self.apply(r)
        else:
            invalid, screened = merged
            t2 = t1
            await self.faulted(r)
        rejected.update(invalid)
        rejected.update(screened)
        applied = {node for node in blobs if node not in invalid and node not in screened}
        t3 = time.perf_counter()
        mass = await self.settle(pending, manifest, applied)
        # The state on disk is written only without a trained round to finish again from, and
        # at the run's end (``save_applied``).
        trained = pending is not None and r + 1 < d.worker.run.rounds
        fingerprint, eval_loss, eval_s = await d.node("after_apply", trained, self.evaluates(r))
        d.spool.drop(r)
        t4 = time.perf_counter()
        if pending is not None:
            pending.timings.update(
                download=gathered.download_s, decode=t2 - t1, aggregate_apply=t3 - t2
            )
            # After the state file written when training ended (``save_submitting``).
            pending.timings["save"] = pending.timings.get("save", 0.0) + t4 - t3 - eval_s
            if eval_loss is not None:
                pending.timings["eval"] = eval_s
        facts = {
            "fingerprint": fingerprint,
            "rejected": rejected,
            "bytes_up": pending.bytes_up if pending else 0,
            "bytes_down": sum(e.size for e in manifest.gather if e.node_id in blobs),
            "retries": d.retries_since_last_report(),
        }
        d.budgeting.meter.downloaded(facts["bytes_down"], gathered.download_s)
        measured = {
            "train_loss": pending.train_loss if pending else None,
            "tokens_per_s": pending.tokens_per_s if pending else None,
            "mfu": pending.mfu if pending else None,
            "eval_loss": eval_loss,
            "timings": pending.timings if pending else {},
            "mass": mass,
            **self.work(pending),
        }
        try:
            report = RoundReport.model_validate({**facts, **measured})
        except ValidationError as exc:
            # A diverged model's losses (inf, NaN) are not worth stopping for: the fingerprint
            # and the rest still go out.
            d.log("report_trimmed", error=repr(exc.errors()[0]["msg"]))
            report = RoundReport.model_validate(facts)
        d.pending = None
        d.log(
            "applied",
            applied_round=r,
            gather=",".join(e.node_id for e in manifest.gather) or "-",
            fingerprint=fingerprint,
            eval_loss=f"{eval_loss:.4f}" if eval_loss is not None else "-",
        )
        await self.report(r, report)
        await d.sync.offer(d.worker)

    def work(self, pending: PendingRound | None) -> dict[str, object]:
        """What the report says of the round's work: its steps and tokens, the entries per tile
        when the link carried fewer than the run's, and what cut it short."""
        d = self.d
        if pending is None:
            return {"cut": "observing"} if d.budgeting.observing else {}
        topk = pending.topk if pending.topk and pending.topk < d.worker.run.topk else None
        return {"steps": pending.steps, "tokens": pending.tokens, "cut": pending.cut, "topk": topk}

    # -- the steps -----------------------------------------------------------------------------

    async def wait(self, r: int) -> ManifestView | None:
        """Round r's manifest once it closed; None if a stop was requested first."""
        d = self.d
        with d.condition.doing(idle=True):
            while not d.stopping.is_set():
                out = await d.until_stopped(d.api.manifest(r))
                if isinstance(out, ManifestView):
                    return out
                if isinstance(out, RoundView):
                    await self.resubmit_if_lost(r, out)
        return None

    async def resubmit_if_lost(self, r: int, view: RoundView) -> None:
        """Submit again a payload of round r the coordinator says it never got.

        After ``submit`` the coordinator either holds the submission or closed the round; a
        round still open that expects this node and holds nothing from it means the coordinator
        lost it: it was restored from a backup taken before the submission
        (``coordinator.store.catchup``). The payload is still in hand, so the round need not go on
        without it.
        """
        d = self.d
        pending = d.pending
        if pending is None or pending.round != r or pending.submitted_at is None:
            return
        lost = view.round == r and view.state == RoundState.OPEN and not view.submitted
        if lost and view.expected:
            d.log("resubmit", submitted_round=r, why="unknown_to_coordinator")
            await submit(d, pending)

    def verify(self, view: ManifestView, r: int) -> Manifest:
        """The manifest, once signed by the key from the join and for this run and round."""
        d = self.d
        joined = d.joined
        if joined is None:
            raise RuntimeError("the node has not joined yet")
        return verify_manifest(
            view.signed, joined.manifest_public_key, run_id=joined.run_id, round_=r
        )

    async def diverged(self, r: int, manifest: Manifest) -> bool:
        """Whether θ is not the θ round r's payloads were trained from.

        With a delayed or eager overlap the payloads of round r ≥ 1 were trained from θ_{r-1}
        while the node now holds θ_r: the fingerprint it had before its last apply is compared
        (unknown right after a restart or a checkpoint, when the coordinator's vote is the only
        check).
        """
        d = self.d
        base = manifest.base_fingerprint
        if base is None:
            return False
        if d.worker.run.late_base and r > 0:
            ours = d.worker.previous_fingerprint
            if ours is None:
                return False
        else:
            ours = await d.node("fingerprint")
        if ours == base:
            return False
        d.log("diverged", ours=ours, manifest=base)
        return True

    async def download(
        self, r: int, view: ManifestView, manifest: Manifest, pending: PendingRound | None
    ) -> tuple[Blobs, Rejected] | None:
        """The whole gather set; None if the node skipped ahead to a checkpoint or was stopped.

        404 on every attempt means retention already deleted this round's payloads, so the node
        is further behind than replay reaches: a newer checkpoint is the way forward, and
        without one the node cannot go on (it says so and stops).
        """
        try:
            return await self.fetch(r, view, manifest, pending)
        except TransferError as exc:
            if exc.status != 404:
                raise
            if await self.skip_to_checkpoint(r, manifest, pending):
                return None
            raise TransferError(
                f"round {r}'s payloads are gone from the store and no newer checkpoint exists;"
                " this node cannot catch up (restart it with an empty --state-dir to start"
                " from the run's newest checkpoint once there is one)",
                404,
            ) from exc

    async def fetch(
        self, r: int, view: ManifestView, manifest: Manifest, pending: PendingRound | None
    ) -> tuple[Blobs, Rejected] | None:
        """The whole gather set, never a part of it; None if a stop was requested meanwhile.

        Leaving out a payload that only *this* node failed to fetch would make it apply another
        aggregate than its peers and drift away from them. So a failed transfer (after its own
        retries) waits, fetches the manifest again for fresh URLs and starts over, for as long
        as the store stays away (``settings.outage_budget_s``, by default forever), logging
        once when it starts waiting and once when it is through. A 404 is tried a few times
        only (the payload may just not be visible yet), then left to the caller.
        """
        d = self.d
        backoff = Backoff()
        waiting_since: float | None = None
        missing = 0
        while True:
            try:
                fetched = await fetch_gather(
                    d.transfers,
                    view,
                    manifest,
                    parallel=d.settings.parallel_downloads,
                    spool=d.spool.folder(r),
                )
            except TransferError as exc:
                if exc.status == 404:
                    # Gone, or not visible yet: look again at once, a few times.
                    missing += 1
                    if missing >= MISSING_ATTEMPTS:
                        raise
                    failure: Exception | None = None
                else:
                    failure = exc
            except RetriesExhausted as exc:
                failure = exc
            else:
                if waiting_since is not None:
                    d.log("download_resumed", waited_s=f"{d.clock.now() - waiting_since:.1f}")
                return fetched
            if failure is not None:
                missing = 0
                now = d.clock.now()
                if waiting_since is None:
                    waiting_since = now
                    # The store's link logged the outage; this says which round waits on it.
                    d.log("download_waiting", applied_round=r, cause=repr(cause(failure)))
                elif now - waiting_since > d.settings.outage_budget_s:
                    raise failure
                await d.sleep(backoff.next())
            fresh = await self.wait(r)  # fresh URLs (the old ones may have expired)
            if fresh is None:
                return None
            view = fresh

    async def skip_to_checkpoint(
        self, r: int, manifest: Manifest, pending: PendingRound | None
    ) -> bool:
        """Retention deleted round r's payloads (404): continue from a newer checkpoint.

        False if there is none past r; the caller then stops (the worker may hold that older
        checkpoint by now, and nothing of it was saved).
        """
        d = self.d
        info = await d.sync.restore_latest(d.worker)
        if info is None or info.round <= r:
            return False
        # Our own payload of this round (after a restart) was either aggregated by the
        # others, so e already lacks it, or not, so it goes back into e: nothing is lost.
        if pending is not None and d.node_id not in {e.node_id for e in manifest.gather}:
            await d.give_back(pending.round)
        d.pending = None
        d.spool.drop(r)
        await d.save_idle()
        d.log("skipped_to_checkpoint", checkpoint=info.round)
        return True

    async def apply(self, r: int) -> dict[str, str]:
        """Aggregate and apply the payloads ``read_gather`` validated (θ becomes θ_{r+1}); the
        peers screened out, with the reason. Also the chaos suite's faults of this point."""
        d = self.d
        screened: dict[str, str] = await d.node("apply")
        await self.faulted(r)
        return screened

    async def faulted(self, r: int) -> None:
        """The chaos suite's faults of the point after applying round r (in memory only)."""
        d = self.d
        d.faults.crash_point(r, "mid_apply")

    async def settle(
        self, pending: PendingRound | None, manifest: Manifest, applied: set[str]
    ) -> Mass | None:
        """The own contribution: sent if aggregated, else back into e; its mass account."""
        d = self.d
        if pending is None:
            return None
        aggregated = d.node_id in applied
        carried, held_now = await d.node("settle", pending.round, aggregated)  # Σĉ, Σe
        if aggregated:
            sent = carried
        else:
            sent = 0.0
            d.log("contribution_kept", reason=repr(manifest.excluded.get(d.node_id, "rejected")))
        if pending.computed is None or pending.scale is None:
            return None
        if d.worker.run.overlaps:
            # e already holds the next round's residual: the round's own is what compression
            # left (measured then), plus ĉ if it came back.
            if pending.held is None:
                return None
            held = pending.held + (0.0 if aggregated else carried)
        else:
            held = held_now
        try:
            return Mass(computed=pending.computed, sent=sent, held=held, scale=pending.scale)
        except ValidationError:  # a diverged buffer's sums leave the wire's bounds
            d.log("mass_unreportable", computed=pending.computed, held=held)
            return None

    def evaluates(self, r: int) -> bool:
        """Whether the node measures the held-out loss after round r: the run's schedule, or
        the node's ``eval_every`` setting where its operator gave one (0: never)."""
        s = self.d.settings
        if "eval_every" in s.model_fields_set:
            return bool(s.eval_every) and (r + 1) % s.eval_every == 0
        return self.d.worker.run.evaluates(r)

    async def report(self, r: int, report: RoundReport) -> None:
        try:
            await self.d.api.report(r, report)
        except CoordinatorError as exc:
            if exc.error == "not_member":
                # A round replayed in a catch-up, closed while this node was away: it took no
                # part, so its fingerprint is not asked for. Nothing to fix; not worth a line.
                log.debug("event=report_not_asked round=%d", r)
                return
            self.d.log("report_refused", error=exc.error)
