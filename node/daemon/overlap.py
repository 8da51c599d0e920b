"""Overlapped rounds: round k's transfers travel while round k+1 trains.

With the run's ``overlap`` on, a node never waits on the network between rounds. One step of the
round loop, with θ = θ_k and the node's round-k payload pending (trained, maybe not sent yet):

    compute thread  | train round k+1 from θ_k ("eager": from θ_k minus an estimate of the step
                    | round k's aggregate will take, ``Worker.eager_offset``), compress it
    event loop      | upload and submit round k's payload once round k is open, wait for round k's
                    | manifest, download its gather set
    then            | verify, decode, apply round k (θ becomes θ_{k+1}), settle and report it
                    | (``RoundFinisher.conclude``), and commit round k+1 as the pending round

So every payload of round k+1 is trained from θ_k, and the coordinator checks exactly that base
(``RunConfig.base_round``). θ_{k+1} itself, what every node applies and agrees on, is what it
is without overlap: only where each node's local training starts differs. The state on disk has
the same shape as without overlap ("submitting k+1" with θ_{k+1}), so a restart resumes the same
way, and a crash before the commit finishes round k again from its manifest and trains round k+1
again (``node.daemon.pending``).

"merge" (``node.daemon.merge``) trains round k+1 from θ_k too, but the compute thread waits at
inner step τ for round k's gather set and applies it there: θ is θ_{k+1} when the training ends,
round k+1's payload is based on it, and round k is concluded without applying it again.

Rounds the node cannot train beside (round 0, which has nothing in flight; the run's last round;
rounds that closed while the node was away) go through the plain steps of ``node.daemon.loop``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

from node.compute.linkbudget import Plan
from node.compute.worker import TrainResult
from node.daemon.budgeting import Budgeting
from node.daemon.host import RoundDaemon
from node.daemon.merge import Handoff
from node.daemon.pending import PendingRound
from node.daemon.rounds import Gathered, RoundFinisher
from node.daemon.upload import submit
from node.errors import Abandoned, TransferError
from protocol.messages import RoundState, RoundView

CLOSED = RoundState.CLOSED

#: Seconds between looks at the coordinator while the round a payload is for has not opened.
OPEN_POLL_S = 0.25


class OverlapDaemon(RoundDaemon, Protocol):
    """What an overlapped step needs of the daemon (``node.daemon.loop.NodeDaemon``): what
    finishing a round needs (``node.daemon.host``), its finisher, and training."""

    @property
    def finisher(self) -> RoundFinisher: ...

    budgeting: Budgeting

    def trained(self, r: int, result: TrainResult, chosen: Plan) -> PendingRound: ...

    async def train(
        self,
        round_: int | None = None,
        eager_from: int | None = None,
        merge: Handoff | None = None,
    ) -> TrainResult: ...

    async def save_trained(self, pending: PendingRound) -> None: ...


def beside(d: OverlapDaemon, view: RoundView) -> bool:
    """Whether the next round can train beside the transfers of the round θ is at: not the
    run's last round, not a closed round being caught up on, and not round 0's first training
    (nothing in flight yet), also while round 0 still waits for members: then no one is
    expected yet, but this node will be once it opens."""
    k = d.worker.round
    if k + 1 >= d.worker.run.rounds or view.round > k + 1:
        return False
    first = k == 0 and d.pending is None and view.round == 0
    return not (first and (view.expected or view.state == RoundState.WAITING))


async def step(d: OverlapDaemon) -> None:
    """Train round k+1 while round k's payloads travel, then apply round k and commit k+1."""
    k = d.worker.round
    pending = d.pending if d.pending is not None and d.pending.round == k else None
    eager_from = k if d.worker.run.overlap == "eager" and pending is not None else None
    merging = d.worker.run.overlap == "merge"
    travel = asyncio.create_task(communicate(d, pending, k, merging), name=f"round-{k}-transfers")
    handoff = Handoff(k, asyncio.get_running_loop(), travel) if merging else None
    d.budgeting.begin()
    try:
        try:
            result = await d.train(k + 1, eager_from, handoff)
        finally:
            chosen = d.budgeting.disarm(d.worker)
    except Abandoned:
        if handoff is None or d.stopping.is_set():
            d.log("training_abandoned")
            await _cancel(travel)
            return
        # (merge) Nothing came to merge at step τ, θ untouched: round k the plain way.
        await travel  # what it failed with, if it did
        d.log("merge_abandoned", applied_round=k, diverged=handoff.diverged)
        await d.finisher.finish(k)
        return
    except BaseException:
        await _cancel(travel)
        raise
    d.faults.crash_point(k + 1, "after_train")
    speed = result.throughput.log_fields() if result.throughput else {}
    d.log("trained", loss=f"{result.train_loss:.4f}", bytes=len(result.payload), beside=k, **speed)
    gathered = await travel
    merged = handoff.applied if handoff is not None else None
    if gathered is None or d.worker.round != (k if merged is None else k + 1):
        # Stopped, or θ moved elsewhere (a checkpoint after the round was pruned): round k+1
        # was trained from a θ that is gone, so what it computed goes back into e.
        await _give_back(d, k + 1)
        return
    finisher = d.finisher
    if merged is None and await finisher.diverged(k, gathered.manifest):
        await _give_back(d, k + 1)
        await d.resync()
        return
    await finisher.conclude(k, gathered, merged)
    following = d.trained(k + 1, result, chosen)
    if handoff is not None:  # the wait at step τ is on the training clock but trains nothing
        following.timings["train"] -= handoff.waited_s
        following.timings["merge_wait"] = handoff.waited_s
    await d.save_trained(following)
    d.pending = following


async def communicate(
    d: OverlapDaemon, pending: PendingRound | None, k: int, merging: bool = False
) -> Gathered | None:
    """(event loop, beside training) Send round k's payload, then fetch round k's gather set.

    None if a stop was requested, or if round k's payloads were pruned and the node moved to a
    checkpoint instead (``RoundFinisher.download``). ``merging``: the compute thread waits for
    this at step τ, so nothing here may need it: pruned payloads give None (and the round loop
    then skips to the checkpoint itself).
    """
    finisher = d.finisher
    if pending is not None and pending.submitted_at is None:
        delay = d.faults.slow_for(k)
        if delay:
            d.log("fault_slow", seconds=delay)
            await d.sleep(delay)
        await send_when_open(d, pending)
    view = await finisher.wait(k)
    if view is None:
        return None
    await arm_next(d, k + 1)
    finisher.waited(pending)
    manifest = finisher.verify(view, k)
    t0 = time.perf_counter()
    if merging:
        try:
            fetched = await finisher.fetch(k, view, manifest, pending)
        except TransferError as exc:
            if exc.status != 404:
                raise
            return None
    else:
        fetched = await finisher.download(k, view, manifest, pending)
    if fetched is None:
        return None
    return Gathered(manifest, *fetched, time.perf_counter() - t0)


async def arm_next(d: OverlapDaemon, round_: int) -> None:
    """Round ``round_``, whose training is under way, has opened (the one before closed): its
    budget is known now, so the training in progress gets its cutoff and k
    (``node.daemon.budgeting``)."""
    if not d.budgeting.training:
        return  # it ended already (it waits for this round's transfers): nothing to cut
    view = await d.api.round()
    opened = view.round == round_ and view.state == RoundState.OPEN
    if opened and view.budget_in_s is not None and d.budgeting.training:
        d.budgeting.arm(d.worker, d.budgeting.plan(view, d.worker))


async def send_when_open(d: OverlapDaemon, pending: PendingRound) -> None:
    """Submit ``pending`` once its round opens; nothing if the round went on without the node
    (closed before, or it is not expected): then step 9 keeps the contribution."""
    r = pending.round
    while not d.stopping.is_set():
        view = await d.api.round()
        if view.round > r or (view.round == r and view.state in (CLOSED, RoundState.FINISHED)):
            # Closed already: sent before a restart, or too late; the manifest will say.
            d.log("send_skipped", reason="round_closed")
            pending.submitted_at = d.clock.now()
            return
        if view.round == r and view.state == RoundState.OPEN:
            if view.submitted:
                pending.submitted_at = d.clock.now()
            elif view.expected:
                await submit(d, pending)
            else:
                d.log("missed_round", reason="not_expected")
                pending.submitted_at = d.clock.now()
            return
        await d.sleep(OPEN_POLL_S)  # round r-1 is still open, or round r waits for members


async def _give_back(d: OverlapDaemon, round_: int) -> None:
    """A trained round that will not be sent: ĉ back into e (nothing the node computed is lost
    while it keeps running; the state on disk never had it)."""
    if d.stopping.is_set():
        return
    await d.give_back(round_)


async def _cancel(task: asyncio.Task[Gathered | None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task  # what it failed with matters less than what ended the step
