"""The node daemon: DESIGN.md's round loop against a coordinator and an object store.

One event loop (uvloop) does all the waiting: coordinator calls, uploads and downloads,
heartbeats. All compute (training, encoding, decoding, aggregation, saving) runs in one worker
thread, one job at a time, so the loop stays responsive and the compiled codec is never entered
twice at once. The coordinator, the store and the clock come in as the small Protocols of
``node.daemon.api``; ``run_node`` builds the HTTP ones.

A round, for round r with θ_r in the model:

1. ask the coordinator for the current round; if r is already closed, only *apply* it (catch-up:
   a late joiner replays every closed round from θ_0 or a checkpoint, bit for bit);
2. if expected in r: train H steps, compress (``node.compute.worker``), save the pending payload
   and the state, upload through the presigned PUT, submit with the payload's sha256 and the base
   fingerprint;
3. finish the round (``node.daemon.rounds``): wait for the signed manifest, download, verify,
   decode, aggregate in node-id order, apply, settle the own contribution, save, report.

SIGTERM or Ctrl-C sets a stop flag: training is abandoned between inner steps (θ and e are
untouched), a round already submitted stays pending in the saved state, the node leaves and
exits 0. A restart resumes from the saved state and re-sends a pending payload unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp
import torch

from node.compute.state import STATE_FILE, load_state
from node.compute.worker import Worker
from node.daemon.api import Clock, CoordinatorApi, RealClock, Transfers
from node.daemon.checkpoints import CheckpointSync
from node.daemon.client import ClientTimeouts, CoordinatorClient
from node.daemon.faults import Faults
from node.daemon.pending import PendingRound, resume, save_idle, save_submitting
from node.daemon.retry import RetryPolicy
from node.daemon.rounds import RoundFinisher
from node.daemon.settings import NodeSettings
from node.daemon.transfer import HttpTransfers, TransferTimeouts
from node.errors import (
    Abandoned,
    CoordinatorError,
    RetriesExhausted,
    StateError,
    TransferError,
)
from protocol.errors import SparseLoCoError
from protocol.messages import JoinResponse, RoundState, RoundView, SubmitRequest

log = logging.getLogger("sparseloco.node")

T = TypeVar("T")

CLIENT = "sparseloco-node/0.1"
#: Seconds between polls of a round that waits for enough members.
WAITING_POLL_S = 0.25

#: Refusals that mean "this round went on without us"; the contribution stays in e.
_MISSED = frozenset({"round_closed", "not_expected", "already_submitted", "run_finished"})


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
    ) -> None:
        self.settings = settings
        self.api = api
        self.transfers = transfers
        self.clock: Clock = clock or RealClock()
        self.faults = faults if faults is not None else Faults.from_env()
        self.stopping = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.joined: JoinResponse | None = None
        self._worker: Worker | None = None
        #: The round trained and compressed but not yet applied; None between rounds.
        self.pending: PendingRound | None = None
        self.sync = CheckpointSync(api, transfers, self.compute)
        self.finisher = RoundFinisher(self)

    # -- plumbing -------------------------------------------------------------------------------

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the compute thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    def request_stop(self) -> None:
        """What SIGTERM and Ctrl-C do: finish or abandon the round cleanly, then leave."""
        if not self.stopping.is_set():
            log.info("event=stop_requested node=%s", self.node_id)
            self.stopping.set()
            if self._worker is not None:
                self._worker.stop.set()

    @property
    def node_id(self) -> str:
        return self.joined.node_id if self.joined else "?"

    @property
    def worker(self) -> Worker:
        if self._worker is None:
            raise RuntimeError("the node has not joined yet")
        return self._worker

    def log(self, event: str, **fields: object) -> None:
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        round_ = self._worker.round if self._worker else "-"
        log.info("event=%s node=%s round=%s %s", event, self.node_id, round_, extra)

    async def sleep(self, seconds: float) -> None:
        """Pause on the daemon's clock; a stop request ends the pause at once."""
        await self.until_stopped(self.clock.sleep(seconds))

    async def until_stopped(self, work: Awaitable[T]) -> T | None:
        """``work``'s result, or None (``work`` cancelled) if a stop is requested first."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return task.result() if not task.cancelled() else None

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self, *, handle_signals: bool = True) -> int:
        """Join, take part until the run ends or a stop is requested, leave; the exit status."""
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_stop)
        try:
            self.joined = await self.api.join(client=CLIENT)
            self._worker, self.pending, resumed = await self.compute(self._setup, self.joined)
            if not resumed:
                # No usable local state: start from the newest checkpoint if there is one
                # (else θ_0); the loop replays the manifests since.
                await self.sync.restore_latest(self.worker)
                await self.compute(self.save_idle)
            self.log("joined", run=self.joined.run_id, slot=self.joined.slot)
            heartbeat = asyncio.create_task(self._heartbeat(), name="heartbeat")
            try:
                finished = await self._loop()
            finally:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
            if not finished:
                with contextlib.suppress(SparseLoCoError, aiohttp.ClientError, TimeoutError):
                    await asyncio.wait_for(self.api.leave(), self.settings.request_timeout_s)
                self.log("left")
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            self.executor.shutdown(wait=True)
        return 0

    def _setup(self, joined: JoinResponse) -> tuple[Worker, PendingRound | None, bool]:
        """The worker, the pending round, and whether usable local state was restored."""
        s = self.settings
        if s.threads:
            torch.set_num_threads(s.threads)
        worker = Worker(
            joined.run,
            run_id=joined.run_id,
            node_id=joined.node_id,
            slot=joined.slot,
            data=s.data,
            eval_batches=s.eval_batches,
            eval_batch_size=s.eval_batch_size,
        )
        try:
            state = load_state(s.state_dir, worker.shapes)
        except StateError as exc:
            # Torn or damaged: keep the evidence, recover from the object store instead.
            aside = s.state_dir / f"{STATE_FILE}.damaged-{int(time.time())}"
            (s.state_dir / STATE_FILE).rename(aside)
            log.warning(
                "event=state_damaged node=%s moved_to=%s error=%r", joined.node_id, aside, exc
            )
            state = None
        if state is None:
            return worker, None, False
        if state.run_id != joined.run_id or state.node_id != joined.node_id:
            raise StateError(
                f"{s.state_dir} holds node {state.node_id!r} of run {state.run_id!r}, not"
                f" {joined.node_id!r} of {joined.run_id!r}; use another --state-dir"
            )
        worker.restore(state)
        pending = resume(s.state_dir, state, worker.fingerprint())
        log.info(
            "event=resumed node=%s round=%d phase=%s", joined.node_id, state.round, state.phase
        )
        return worker, pending, True

    def save_idle(self) -> str:
        """(compute thread) θ, e and AdamW to disk with nothing pending; θ's fingerprint."""
        return save_idle(self.settings.state_dir, self.worker)

    async def _heartbeat(self) -> None:
        interval = self.joined.heartbeat_interval_s if self.joined else 5.0
        while True:
            await self.clock.sleep(interval)
            try:
                await self.api.heartbeat()
            except CoordinatorError as exc:
                if exc.error == "not_member" and not self.stopping.is_set():
                    self.log("rejoin")
                    with contextlib.suppress(SparseLoCoError):
                        await self.api.join(client=CLIENT)
            except SparseLoCoError as exc:
                self.log("heartbeat_failed", error=repr(exc))

    # -- the round loop ------------------------------------------------------------------------

    async def _loop(self) -> bool:
        """Rounds until the run is over (True) or a stop is requested (False)."""
        run = self.worker.run
        while not self.stopping.is_set():
            r = self.worker.round
            if r >= run.rounds:
                return True
            view = await self.api.round()
            if r > view.round:
                raise StateError(
                    f"local state is at round {r} but the coordinator is at {view.round};"
                    " this state dir belongs to another coordinator database"
                )
            if self.pending is not None:
                await self._resume_pending(view)
            elif r < view.round:
                await self.finisher.finish(r)  # catch up on a closed round
            elif view.state == RoundState.OPEN and view.expected and not view.submitted:
                await self._participate(r)
            elif view.state == RoundState.WAITING:
                await self.sleep(WAITING_POLL_S)
            else:
                await self.finisher.finish(r)
        return False

    async def _participate(self, r: int) -> None:
        """Steps 1-5 and the upload, then the rest of the round."""
        try:
            result = await self.compute(self.worker.train_and_compress)
        except Abandoned:
            self.log("training_abandoned")
            return
        self.faults.crash_point(r, "after_train")
        pending = PendingRound.trained(r, result)
        await self.compute(save_submitting, self.settings.state_dir, self.worker, pending)
        self.pending = pending
        self.log("trained", loss=f"{result.train_loss:.4f}", bytes=len(result.payload))
        delay = self.faults.slow_for(r)
        if delay:
            self.log("fault_slow", seconds=delay)
            await self.sleep(delay)
        await self._submit(pending)
        await self.finisher.finish(r)

    async def _resume_pending(self, view: RoundView) -> None:
        """After a restart with a trained, unsent (or unconfirmed) payload for this round."""
        pending = self.pending
        if pending is None:
            raise StateError("no pending round to resume")
        r = pending.round
        if r == view.round and view.state == RoundState.OPEN and not view.submitted:
            await self._submit(pending)
        await self.finisher.finish(r)

    async def _submit(self, pending: PendingRound) -> None:
        """Upload through a presigned PUT and announce it; a missed round is not an error."""
        r, payload = pending.round, pending.payload
        t0 = time.perf_counter()
        pending.bytes_up = 0
        try:
            grant = await self.api.upload_grant(r, len(payload), pending.sha256)
            self.faults.crash_point(r, "mid_upload")
            await self.transfers.put(grant.url, grant.headers, payload)
            pending.bytes_up = len(payload)
            pending.timings["upload"] = time.perf_counter() - t0
            self.faults.crash_point(r, "after_upload")
            request = SubmitRequest(
                size=len(payload), sha256=pending.sha256, base_fingerprint=pending.base
            )
            response = await self.api.submit(r, request)
            if not response.accepted:
                self.log("submission_rejected", reason=repr(response.reason))
            self.faults.crash_point(r, "after_submit")
        except CoordinatorError as exc:
            if exc.error not in _MISSED:
                raise
            self.log("missed_round", reason=exc.error)
        except (TransferError, RetriesExhausted) as exc:
            # The round goes on without this payload; step 9 keeps its contribution.
            self.log("upload_failed", error=repr(exc))
        pending.submitted_at = self.clock.now()

    async def resync(self) -> None:
        """θ differs from the round's base: start again from the newest checkpoint (or θ_0).

        A pending payload trained from the wrong θ goes back into the error buffer first, so
        nothing this node computed is lost; the loop then replays the manifests since.
        """
        if self.pending is not None:
            await self.return_own(self.pending)
        self.pending = None
        info = await self.sync.restore_latest(self.worker)
        if info is None:
            await self.compute(self.worker.reset_to_initial)
        await self.compute(self.save_idle)
        self.log("resynced", source=f"checkpoint {info.round}" if info else "θ_0")

    async def own_recon(self, pending: PendingRound) -> dict[str, torch.Tensor]:
        """ĉ of the pending payload: kept from the encoder, decoded only after a restart."""
        if pending.recon is None:
            pending.recon = await self.compute(self.worker.own_recon, pending.payload)
        return pending.recon

    async def return_own(self, pending: PendingRound) -> None:
        """Step 9: the pending payload was not aggregated; its ĉ goes back into e."""
        await self.compute(self.worker.return_own, await self.own_recon(pending))


async def serve(settings: NodeSettings) -> int:
    """The daemon with its HTTP seams: the coordinator client and presigned transfers."""
    timeouts = ClientTimeouts(
        connect_s=settings.connect_timeout_s, request_s=settings.request_timeout_s
    )
    policy = RetryPolicy(attempts=1000, max_delay_s=5.0, budget_s=settings.coordinator_budget_s)
    transfer_timeouts = TransferTimeouts(
        connect_s=settings.connect_timeout_s, transfer_s=settings.transfer_timeout_s
    )
    async with aiohttp.ClientSession() as http:
        api = CoordinatorClient(
            http, settings.coordinator, settings.token, timeouts=timeouts, policy=policy
        )
        return await NodeDaemon(settings, api, HttpTransfers(http, transfer_timeouts)).run()


def run_node(settings: NodeSettings) -> int:
    """Run a node to completion on uvloop; the exit status."""
    import uvloop

    return uvloop.run(serve(settings))
