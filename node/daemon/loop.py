"""The node daemon: DESIGN.md's round loop against a coordinator and an object store.

One event loop (uvloop) does all the waiting: coordinator calls, uploads and downloads,
heartbeats. All compute (training, encoding, decoding, aggregation, saving) runs in one worker
thread, one job at a time, so the loop stays responsive and the compiled codec is never entered
twice at once. The coordinator, the store and the clock come in as the small Protocols of
``node.daemon.api``; ``node.daemon.serve.run_node`` builds the HTTP ones.

A round, for round r with θ_r in the model:

0. join (``node.daemon.join``): the manifest key of the join response must be the one the
   operator's invite names and the one pinned in the state dir (``node.daemon.pinning``);
   manifests are verified with that pinned key only;
1. ask the coordinator for the current round; if r is already closed, only *apply* it (catch-up:
   a late joiner replays every closed round from θ_0 or a checkpoint, bit for bit);
2. if expected in r: train until H steps or the round's budget (``node.daemon.budgeting``),
   compress (``node.compute.worker``), save the pending payload and the state, upload through
   the presigned PUT, submit with the payload's sha256, its work and the base fingerprint;
3. finish the round (``node.daemon.rounds``): wait for the signed manifest, download, verify,
   decode, aggregate in node-id order, apply, settle the own contribution, save, report.

SIGTERM or Ctrl-C sets a stop flag: training is abandoned between inner steps (θ and e are
untouched), a round already submitted stays pending in the saved state, the node leaves and
exits 0. A restart resumes from the saved state and re-sends a pending payload unchanged. A
token the coordinator stops accepting (revoked: 401 ``token_revoked``) is learnt by the
heartbeat within one interval (``node.daemon.lifetime``): the round in hand is abandoned at once
and ``run`` raises ``Refused`` (exit status 2, one line saying why and what to do).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp

from node.compute.group import Group
from node.compute.linkbudget import Plan
from node.compute.worker import TrainResult, Worker
from node.daemon import overlap
from node.daemon.api import Clock, CoordinatorApi, RealClock, Transfers
from node.daemon.budgeting import Budgeting
from node.daemon.checkpoints import CheckpointSync
from node.daemon.condition import Condition
from node.daemon.dataset import open_run_data
from node.daemon.faults import Faults
from node.daemon.gather import Spool
from node.daemon.join import join, refusal
from node.daemon.lifetime import heartbeat, until_stopped, with_grace
from node.daemon.merge import Handoff
from node.daemon.ops import NodeCompute, RankContext
from node.daemon.pending import PendingRound
from node.daemon.resync import ResyncGuard, refuse_if_ahead, resync
from node.daemon.retry import Link
from node.daemon.rounds import RoundFinisher
from node.daemon.settings import NodeSettings
from node.daemon.upload import submit
from node.errors import Abandoned, CoordinatorError, Refused, StateError
from protocol.errors import SparseLoCoError
from protocol.messages import JoinResponse, RoundState, RoundView

log = logging.getLogger("sparseloco.node")

T = TypeVar("T")

#: Seconds between polls of a round that waits for enough members.
WAITING_POLL_S = 0.25


class NodeDaemon:
    """Runs one node until the run finishes or a stop is requested."""

    def __init__(
        self,
        settings: NodeSettings,
        api: CoordinatorApi,
        transfers: Transfers,
        *,
        clock: Clock | None = None,
        faults: Faults | None = None,
        links: Sequence[Link] = (),
        group: Group | None = None,
    ) -> None:
        """``group``: on rank 0 of a torchrun node, the node's processes, which take every
        compute step with it (``node.daemon.ops``); one process by default."""
        self.settings = settings
        self.api = api
        self.transfers = transfers
        self.clock: Clock = clock or RealClock()
        self.faults = faults if faults is not None else Faults.from_env()
        self.stopping = asyncio.Event()
        self.compute_stop = threading.Event()  # the stop request, for a shard download
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.joined: JoinResponse | None = None
        self.ctx = RankContext(settings, group or Group.solo())
        #: Where a node of several processes downloads a round's payloads.
        self.spool = Spool(settings.state_dir, self.ctx.group.world)
        #: The node's compute, one op at a time on the compute thread (and every other rank).
        self.node = NodeCompute(self.ctx, self.executor)
        #: The round trained and compressed but not yet applied; None between rounds.
        self.pending: PendingRound | None = None
        self.sync = CheckpointSync(
            api,
            transfers,
            self.node,
            settings.state_dir,
            sleep=self.sleep,
            stopped=self.stopping.is_set,
        )
        #: The services' link states (coordinator, store), for the retries each report counts.
        self.links = tuple(links)
        self._retries_reported = 0
        self.finisher = RoundFinisher(self)
        self.resyncs = ResyncGuard()
        #: Why the coordinator stopped accepting this node mid-run (``refuse``); None while it
        #: accepts it.
        self.refused: Refused | None = None
        #: What the node is doing, as its heartbeats and requests say (``node.daemon.condition``).
        self.condition = Condition(self.links)
        self.api.say(self.condition.now)
        #: Each round's time budget: the plan, the link's measurements, observing
        #: (``node.daemon.budgeting``).
        self.budgeting = Budgeting(self.condition, self.clock.now)

    # -- plumbing -------------------------------------------------------------------------------

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the compute thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    def request_stop(self) -> None:
        """What SIGTERM and Ctrl-C do: finish or abandon the round cleanly, then leave."""
        if not self.stopping.is_set():
            log.info("event=stop_requested%s", self._node_field())
            self._halt()

    def refuse(self, refused: Refused) -> None:
        """The coordinator stopped accepting this node (its heartbeat learnt it): abandon the
        round in hand at once, with no grace and no leave, and let ``run`` raise ``refused``."""
        if self.refused is None:
            self.refused = refused
        self._halt()

    def _halt(self) -> None:
        self.stopping.set()
        self.compute_stop.set()  # a shard download
        if self.ctx.shard is not None:
            self.ctx.shard.worker.stop.set()  # training, between inner steps

    @property
    def node_id(self) -> str:
        return self.joined.node_id if self.joined else "?"

    @property
    def worker(self) -> Worker:
        """Rank 0's share of the node's compute: read its fields here, run its methods only
        through ``node`` (every rank must take each step)."""
        return self.ctx.worker

    @property
    def group(self) -> Group:
        return self.ctx.group

    def log(self, event: str, **fields: object) -> None:
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        round_ = self.ctx.shard.worker.round if self.ctx.shard else "-"
        log.info("event=%s%s round=%s %s", event, self._node_field(), round_, extra)

    def _node_field(self) -> str:
        """`` node=ID`` once joined; before the join nothing (the coordinator names the node)."""
        return f" node={self.joined.node_id}" if self.joined else ""

    async def sleep(self, seconds: float) -> None:
        """Pause on the daemon's clock; a stop request ends the pause at once."""
        await self.until_stopped(self.clock.sleep(seconds))

    async def until_stopped(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None (``work`` cancelled) if a stop is requested first."""
        return await until_stopped(self.stopping, work)

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self, *, handle_signals: bool = True) -> int:
        """Join, take part until the run ends or a stop is requested, leave; the exit status.

        Outages of the coordinator or the store are waited out; a stop request is honoured
        within ``settings.stop_grace_s`` in every state. ``Refused`` ends it when the
        coordinator refuses the node for good.
        """
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_stop)
        try:
            joined = await self.until_stopped(join(self.api, self.settings))
            if joined is None:
                self.log("stopped", before="joining")
                return 0
            self.joined = joined
            # Beats from the join on: a node that waits for the store while it sets up (the
            # dataset, a checkpoint) is alive, and must not be timed out of the run meanwhile.
            heartbeat = asyncio.create_task(self._heartbeat(), name="heartbeat")
            try:
                if not await self._set_up(joined):
                    return 0
                finished = await self._rounds_until_stopped()
            finally:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
            if self.refused is not None:
                raise self.refused
            if finished:
                self.log(
                    "run_finished",
                    rounds=self.worker.run.rounds,
                    # an op: on a node of several processes it is a collective of all of them
                    fingerprint=await self.node("fingerprint"),
                )
            else:
                with contextlib.suppress(SparseLoCoError, aiohttp.ClientError, TimeoutError):
                    await asyncio.wait_for(self.api.leave(), max(1.0, self.settings.stop_grace_s))
                self.log("left")
        except CoordinatorError as exc:
            if exc.status == 401 or exc.error == "token_in_use":
                raise refusal(exc) from exc
            raise
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            self.executor.shutdown(wait=True)
        return 0

    async def _set_up(self, joined: JoinResponse) -> bool:
        """Data, model and θ for the run just joined; False if stopped meanwhile."""
        rows, world = joined.run.batch_size, self.group.world
        if rows < world:  # before any op: rank 0 alone says it (``node.daemon.ranks``)
            with contextlib.suppress(SparseLoCoError, aiohttp.ClientError, TimeoutError):
                await asyncio.wait_for(self.api.leave(), max(1.0, self.settings.stop_grace_s))
            raise Refused(
                f"the run's batch_size {rows} is smaller than this node's {world} processes:"
                f" each needs at least one row of every batch; start the node with --ranks"
                f" {rows} or fewer"
            )
        try:
            data = await open_run_data(
                self.api, self.transfers, joined.run, self.settings,
                stop=self.compute_stop, sleep=self.sleep,
            )  # fmt: skip
            root = str(data.root) if data is not None else None
            self.pending, resumed = await self.node(
                "setup", joined.model_dump_json(), root, data=data
            )
            if not resumed:
                # No usable local state: start from the newest checkpoint if there is one
                # (else θ_0); the loop replays the manifests since.
                await self.sync.restore_latest(self.worker)
                await self.save_idle()
        except Abandoned:  # stopped while the dataset, eval shards or checkpoint came
            self.log("stopped", before="training")
            return False
        self.spool.drop()  # what a killed predecessor downloaded
        self.log("joined", run=joined.run_id, slot=joined.slot, ranks=self.group.world)
        return True

    async def _rounds_until_stopped(self) -> bool:
        """The round loop: True when the run finished, False after a stop request (which
        leaves the round in hand ``stop_grace_s``, ``lifetime.with_grace``)."""
        grace_s = self.settings.stop_grace_s
        return await with_grace(
            self._loop(), self.stopping, grace_s,
            refused=lambda: self.refused is not None,
            on_cut=lambda: self.log("stop_cut_round", grace_s=grace_s),
        )  # fmt: skip

    async def save_idle(self) -> str:
        """θ, e and AdamW to disk with nothing pending, all of it now; θ's fingerprint."""
        return str(await self.node("save_idle"))

    async def _heartbeat(self) -> None:
        """Beat into the silences (``lifetime.heartbeat``): a revoked token is learnt within
        one interval and refuses the node."""
        if self.joined is None:
            raise RuntimeError("the node has not joined yet")
        await heartbeat(
            self.api, self.condition, self.clock,
            interval=self.joined.heartbeat_interval_s,
            manifest_key=self.joined.manifest_public_key,
            stopping=self.stopping, refuse=self.refuse, log=self.log,
        )  # fmt: skip

    # -- the round loop ------------------------------------------------------------------------

    async def _loop(self) -> bool:
        """Rounds until the run is over (True) or a stop is requested (False)."""
        run = self.worker.run
        while not self.stopping.is_set():
            r = self.worker.round
            if r >= run.rounds:
                return True
            view = await self.api.round()
            refuse_if_ahead(r, view)
            if run.overlaps and overlap.beside(self, view):
                await overlap.step(self)
            elif self.pending is not None:
                await self._resume_pending(view)
            elif r < view.round:
                await self.finisher.finish(r)  # catch up on a closed round
            elif view.state == RoundState.OPEN and view.expected and not view.submitted:
                if self.budgeting.observes(view, self.worker, r, self.node_id):
                    await self.finisher.finish(r)  # the link cannot carry a payload in time
                else:
                    await self._participate(r, view)
            elif view.state == RoundState.WAITING:
                await self.sleep(WAITING_POLL_S)
            else:
                await self.finisher.finish(r)
        return False

    async def train(
        self,
        round_: int | None = None,
        eager_from: int | None = None,
        merge: Handoff | None = None,
    ) -> TrainResult:
        """Steps 1-5 (``Worker.train_and_compress``) on every rank. ``eager_from``,
        ``merge``: see ``ops.train``."""
        trained = self.worker.round if round_ is None else round_
        self.worker.after_step = self.faults.step_pause(trained)
        with self.condition.doing(idle=False):
            result: TrainResult = await self.node(
                "train", round_, eager_from, merge is not None, merge=merge
            )
        return result

    async def save_trained(self, pending: PendingRound) -> None:
        """The state after training ``pending`` (every rank its part; rank 0 the payload)."""
        pending.timings["save"] = await self.node(
            "save_trained", pending.round, pending.mass, payload=pending.payload
        )

    async def _participate(self, r: int, view: RoundView) -> None:
        """Steps 1-5 and the upload, then the rest of the round (with overlap only steps 1-5:
        ``node.daemon.overlap``), within the round's budget (``node.daemon.budgeting``)."""
        started = self.clock.now()
        self.budgeting.arm(self.worker, self.budgeting.plan(view, self.worker))
        try:
            result = await self.train()
        except Abandoned:
            self.log("training_abandoned")
            return
        finally:
            chosen = self.budgeting.disarm(self.worker)
        trained_s = self.clock.now() - started
        self.faults.crash_point(r, "after_train")
        pending = self.trained(r, result, chosen)
        await self.save_trained(pending)
        self.pending = pending
        speed = result.throughput.log_fields() if result.throughput else {}
        self.log("trained", loss=f"{result.train_loss:.4f}", bytes=len(result.payload), **speed)
        if self.worker.run.overlaps:
            return
        delay = self.faults.slow_for(r) + self.faults.slower_for(r, trained_s)
        if delay:
            self.log("fault_slow", seconds=delay)
            await self.sleep(delay)
        await submit(self, pending)
        await self.finisher.finish(r)

    def trained(self, r: int, result: TrainResult, chosen: Plan) -> PendingRound:  # and its cut
        return self.budgeting.pending(r, result, chosen, self.worker.run, self.log)

    def uploaded(self, size: int, seconds: float) -> None:  # a clean upload measured the link
        self.budgeting.meter.uploaded(size, seconds)

    async def _resume_pending(self, view: RoundView) -> None:
        """After a restart with a trained, unsent (or unconfirmed) payload for this round."""
        pending = self.pending
        if pending is None:
            raise StateError("no pending round to resume")
        r = pending.round
        if r == view.round and view.state == RoundState.OPEN and not view.submitted:
            await submit(self, pending)
        await self.finisher.finish(r)

    async def resync(self) -> None:
        """θ differs from the round's base: start again (``node.daemon.resync``)."""
        await resync(self, self.resyncs)

    @property
    def link_failures(self) -> int:  # failed attempts at the coordinator or the store so far
        return sum(link.failures for link in self.links)

    def retries_since_last_report(self) -> int:
        """Failed attempts at the coordinator or the store since the previous report."""
        total = self.link_failures
        new, self._retries_reported = total - self._retries_reported, total
        return new

    async def give_back(self, round_: int) -> None:
        """Step 9 for trained round ``round_``, which will not be aggregated: ĉ back into e."""
        await self.node("give_back", round_)
