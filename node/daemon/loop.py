"""The node daemon: DESIGN.md's round loop against a real coordinator and object store.

One event loop (uvloop) does all the waiting: coordinator calls, uploads and downloads,
heartbeats. All compute (training, encoding, decoding, aggregation, saving) runs in one worker
thread, one job at a time, so the loop stays responsive and the compiled codec is never entered
twice at once.

A round, for round r with θ_r in the model:

1. ask the coordinator for the current round; if r is already closed, only *apply* it (catch-up:
   a late joiner replays every closed round from θ_0, bit for bit);
2. if expected in r: train H steps, compress (``node.compute.worker``), save the pending payload
   and the state, upload through the presigned PUT, submit with the payload's sha256 and the base
   fingerprint;
3. wait for the signed manifest; download the gather set in parallel (our own payload is used
   from memory), verify digests and payload headers, decode, aggregate in node-id order, apply;
4. if our payload was not aggregated, return ĉ to the error buffer; save state; report the new
   fingerprint, the losses, bytes and per-phase timings.

SIGTERM or Ctrl-C sets a stop flag: training is abandoned between inner steps (θ and e are
untouched), a round already submitted stays pending in the saved state, the node leaves and
exits 0. A restart resumes from the saved state and re-sends a pending payload unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from node.compute.state import (
    PENDING_FILE,
    STATE_FILE,
    load_pending,
    load_state,
    save_pending,
    save_state,
)
from node.compute.worker import Worker
from node.daemon.checkpoints import CheckpointSync
from node.daemon.client import ClientTimeouts, CoordinatorClient
from node.daemon.faults import Faults
from node.daemon.gather import decode_gather, fetch_gather
from node.daemon.retry import RetryPolicy
from node.daemon.settings import NodeSettings
from node.daemon.transfer import TransferTimeouts, put_object
from node.errors import Abandoned, CoordinatorError, RetriesExhausted, StateError, TransferError
from protocol.errors import SparseLoCoError
from protocol.messages import (
    JoinResponse,
    Manifest,
    ManifestView,
    Mass,
    RoundReport,
    RoundState,
    RoundView,
    SubmitRequest,
)
from protocol.signing import verify_manifest

log = logging.getLogger("sparseloco.node")

T = TypeVar("T")

#: Attempts at a round's whole gather set (each with fresh URLs) before the node stops.
DOWNLOAD_ROUNDS = 3

#: Refusals that mean "this round went on without us"; the contribution stays in e.
_MISSED = frozenset({"round_closed", "not_expected", "already_submitted", "run_finished"})


class NodeDaemon:
    """Runs one node until the run finishes or a stop is requested."""

    def __init__(self, settings: NodeSettings) -> None:
        self.settings = settings
        self.stopping = asyncio.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="compute")
        self.worker: Worker | None = None
        self.phase = "idle"
        self.pending: bytes | None = None
        self.joined: JoinResponse | None = None
        self.timings: dict[str, float] = {}
        self.bytes_up = 0
        self.train_loss: float | None = None
        self.mass_in: list[float] | None = None
        self.faults = Faults.from_env()

    # -- plumbing -------------------------------------------------------------------------------

    async def compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn`` on the compute thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args))

    def request_stop(self) -> None:
        if not self.stopping.is_set():
            log.info("event=stop_requested node=%s", self.node_id)
            self.stopping.set()
            if self.worker is not None:
                self.worker.stop.set()

    @property
    def node_id(self) -> str:
        return self.joined.node_id if self.joined else "?"

    @property
    def w(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("the node has not joined yet")
        return self.worker

    def _log(self, event: str, **fields: object) -> None:
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        round_ = self.worker.round if self.worker else "-"
        log.info("event=%s node=%s round=%s %s", event, self.node_id, round_, extra)

    # -- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        s = self.settings
        timeouts = ClientTimeouts(connect_s=s.connect_timeout_s, request_s=s.request_timeout_s)
        policy = RetryPolicy(attempts=1000, max_delay_s=5.0, budget_s=s.coordinator_budget_s)
        self.transfer_timeouts = TransferTimeouts(
            connect_s=s.connect_timeout_s, transfer_s=s.transfer_timeout_s
        )
        try:
            async with aiohttp.ClientSession() as http:
                self.http = http
                self.client = CoordinatorClient(
                    http, s.coordinator, s.token, timeouts=timeouts, policy=policy
                )
                self.joined = await self.client.join(client="sparseloco-node/0.1")
                self.public_key = Ed25519PublicKey.from_public_bytes(
                    bytes.fromhex(self.joined.manifest_public_key)
                )
                self.worker, resumed = await self.compute(self._setup, self.joined)
                self.sync = CheckpointSync(self.client, http, self.transfer_timeouts, self.compute)
                if not resumed:
                    # No usable local state: start from the newest checkpoint if there is
                    # one (else θ_0); the loop replays the manifests since.
                    await self.sync.restore_latest(self.w)
                    await self.compute(self._save_idle)
                self._log("joined", run=self.joined.run_id, slot=self.joined.slot)
                heartbeat = asyncio.create_task(self._heartbeat(), name="heartbeat")
                try:
                    finished = await self._loop()
                finally:
                    heartbeat.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await heartbeat
                if not finished:
                    with contextlib.suppress(SparseLoCoError, aiohttp.ClientError):
                        await asyncio.wait_for(self.client.leave(), s.request_timeout_s)
                    self._log("left")
        finally:
            self.executor.shutdown(wait=True)
        return 0

    def _setup(self, joined: JoinResponse) -> tuple[Worker, bool]:
        """The worker, restored from local state when there is usable state (True)."""
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
            return worker, False
        if state.run_id != joined.run_id or state.node_id != joined.node_id:
            raise StateError(
                f"{s.state_dir} holds node {state.node_id!r} of run {state.run_id!r}, not"
                f" {joined.node_id!r} of {joined.run_id!r}; use another --state-dir"
            )
        worker.restore(state)
        if state.phase == "submitting":
            self.pending = load_pending(s.state_dir)
            if self.pending is None:
                raise StateError(f"{s.state_dir}: state says a payload is pending but none is")
            self.phase = "submitting"
            self.mass_in = state.extra.get("mass_in")
        log.info(
            "event=resumed node=%s round=%d phase=%s", joined.node_id, state.round, state.phase
        )
        return worker, True

    async def _heartbeat(self) -> None:
        interval = self.joined.heartbeat_interval_s if self.joined else 5.0
        while True:
            await asyncio.sleep(interval)
            try:
                await self.client.heartbeat()
            except CoordinatorError as exc:
                if exc.error == "not_member" and not self.stopping.is_set():
                    self._log("rejoin")
                    with contextlib.suppress(SparseLoCoError):
                        await self.client.join(client="sparseloco-node/0.1")
            except SparseLoCoError as exc:
                self._log("heartbeat_failed", error=repr(exc))

    # -- the round loop ------------------------------------------------------------------------

    async def _loop(self) -> bool:
        """Rounds until the run is over (True) or a stop is requested (False)."""
        run = self.w.run
        while not self.stopping.is_set():
            r = self.w.round
            if r >= run.rounds:
                return True
            view = await self.client.round()
            if r > view.round:
                raise StateError(
                    f"local state is at round {r} but the coordinator is at {view.round};"
                    " this state dir belongs to another coordinator database"
                )
            if self.phase == "submitting":
                await self._resume_pending(view)
            elif r < view.round:
                await self._finish_round(r, own=None)  # catch up on a closed round
            elif view.state == RoundState.OPEN and view.expected and not view.submitted:
                await self._participate(r)
            elif view.state == RoundState.WAITING:
                await self._sleep(0.25)
            else:
                await self._finish_round(r, own=None)
        return False

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def _participate(self, r: int) -> None:
        self.timings = {}
        try:
            result = await self.compute(self.w.train_and_compress)
        except Abandoned:
            self._log("training_abandoned")
            return
        self.timings.update(train=result.train_s, encode=result.encode_s)
        self.train_loss = result.train_loss
        self.faults.crash_point(r, "after_train")
        self.pending = result.payload
        self.phase = "submitting"
        self.mass_in = [result.computed, result.scale]
        await self.compute(self._save_pending, result.payload)
        self._log("trained", loss=f"{result.train_loss:.4f}", bytes=len(result.payload))
        delay = self.faults.slow_for(r)
        if delay:
            self._log("fault_slow", seconds=delay)
            await self._sleep(delay)
        await self._submit(r, result.payload, result.base)
        await self._finish_round(r, own=result.payload)

    def _save_pending(self, payload: bytes) -> None:
        save_pending(self.settings.state_dir, payload)
        snapshot = self.w.snapshot("submitting")
        snapshot.extra["mass_in"] = self.mass_in
        save_state(self.settings.state_dir, snapshot)

    def _save_idle(self) -> None:
        save_state(self.settings.state_dir, self.w.snapshot("idle"))
        (self.settings.state_dir / PENDING_FILE).unlink(missing_ok=True)

    async def _resume_pending(self, view: RoundView) -> None:
        """After a restart with a trained, unsent (or unconfirmed) payload for this round."""
        r, payload = self.w.round, self.pending
        if payload is None:
            raise StateError("pending phase without a payload")
        if r == view.round and view.state == RoundState.OPEN and not view.submitted:
            base = self.w.fingerprint()
            await self._submit(r, payload, base)
        await self._finish_round(r, own=payload)

    async def _submit(self, r: int, payload: bytes, base: str) -> None:
        sha = hashlib.sha256(payload).hexdigest()
        t0 = time.perf_counter()
        self.bytes_up = 0
        try:
            grant = await self.client.upload_grant(r, len(payload), sha)
            self.faults.crash_point(r, "mid_upload")
            await put_object(
                self.http,
                grant.url,
                grant.headers,
                payload,
                timeouts=self.transfer_timeouts,
            )
            self.bytes_up = len(payload)
            self.timings["upload"] = time.perf_counter() - t0
            self.faults.crash_point(r, "after_upload")
            response = await self.client.submit(
                r, SubmitRequest(size=len(payload), sha256=sha, base_fingerprint=base)
            )
            if not response.accepted:
                self._log("submission_rejected", reason=repr(response.reason))
            self.faults.crash_point(r, "after_submit")
        except CoordinatorError as exc:
            if exc.error not in _MISSED:
                raise
            self._log("missed_round", reason=exc.error)
        except (TransferError, RetriesExhausted) as exc:
            # The round goes on without this payload; step 9 keeps its contribution.
            self._log("upload_failed", error=repr(exc))
        self._submitted_at = time.perf_counter()

    async def _manifest(self, r: int) -> ManifestView | None:
        """Wait for round r to close; None if a stop was requested first."""
        while not self.stopping.is_set():
            out = await self.client.manifest(r)
            if isinstance(out, ManifestView):
                return out
        return None

    async def _download_all(
        self, r: int, view: ManifestView, manifest: Manifest, own: bytes | None
    ) -> tuple[dict[str, bytes], dict[str, str]]:
        """The whole gather set, or an error: never a part of it.

        Leaving out a payload that only *this* node failed to fetch would make it apply another
        aggregate than its peers and drift away from them. So a failed transfer (after its own
        retries) fetches the manifest again for fresh URLs and starts over, a few times, and
        then gives up loudly; a restart resumes from the saved state.
        """
        attempt = 1
        while True:
            try:
                return await fetch_gather(
                    self.http,
                    view,
                    manifest,
                    own=own,
                    own_id=self.node_id,
                    parallel=self.settings.parallel_downloads,
                    timeouts=self.transfer_timeouts,
                )
            except (TransferError, RetriesExhausted) as exc:
                self._log("download_failed", attempt=attempt, error=repr(exc))
                fresh = await self._manifest(r) if attempt < DOWNLOAD_ROUNDS else None
                if fresh is None:
                    raise
                view, attempt = fresh, attempt + 1

    async def _finish_round(self, r: int, own: bytes | None) -> None:
        """Steps 6-9 for round r: wait, download, verify, aggregate, apply, save, report."""
        t_wait = time.perf_counter()
        view = await self._manifest(r)
        if view is None:
            return
        if own is not None:
            self.timings["wait"] = time.perf_counter() - getattr(self, "_submitted_at", t_wait)
        manifest = verify_manifest(
            view.signed, self.joined.manifest_public_key, run_id=self.w.run_id, round_=r
        )
        base_now = await self.compute(self.w.fingerprint)
        if manifest.base_fingerprint is not None and manifest.base_fingerprint != base_now:
            self._log("diverged", ours=base_now, manifest=manifest.base_fingerprint)
            await self._resync()
            return
        t0 = time.perf_counter()
        try:
            blobs, rejected = await self._download_all(r, view, manifest, own)
        except TransferError as exc:
            # 404: retention already deleted this round's payloads, so this node is further
            # behind than replay can reach; a newer checkpoint is the way forward.
            if exc.status != 404:
                raise
            info = await self.sync.restore_latest(self.w)
            if info is None or info.round <= r:
                raise
            # Our own payload of this round (after a restart) was either aggregated by the
            # others, so e already lacks it, or not, so it goes back into e: nothing is lost.
            if own is not None and self.node_id not in {e.node_id for e in manifest.gather}:
                await self.compute(self.w.return_own, own)
            self.phase, self.pending, self.mass_in = "idle", None, None
            await self.compute(self._save_idle)
            self._log("skipped_to_checkpoint", checkpoint=info.round)
            return
        t1 = time.perf_counter()
        payloads, invalid = await self.compute(decode_gather, self.w, blobs, r)
        rejected.update(invalid)
        t2 = time.perf_counter()
        await self.compute(self.w.apply, payloads)
        t3 = time.perf_counter()
        self.faults.crash_point(r, "mid_apply")
        if self.faults.corrupt_now(r):
            await self.compute(self.w.corrupt)
        mass = None
        if own is not None:
            sent = 0.0
            if self.node_id in payloads:
                sent = await self.compute(self.w.sent_mass, own)
            else:
                await self.compute(self.w.return_own, own)
                reason = manifest.excluded.get(self.node_id, "rejected")
                self._log("contribution_kept", reason=repr(reason))
            if self.mass_in:
                held = await self.compute(self.w.held_mass)
                mass = Mass(computed=self.mass_in[0], sent=sent, held=held, scale=self.mass_in[1])
        fp, eval_loss, eval_s = await self.compute(self._after_apply)
        t4 = time.perf_counter()
        down = sum(len(b) for n, b in blobs.items() if n != self.node_id or own is None)
        if own is not None:
            self.timings.update(download=t1 - t0, decode=t2 - t1, aggregate_apply=t3 - t2)
            self.timings.update(eval=eval_s, save=t4 - t3 - eval_s)
        report = RoundReport(
            fingerprint=fp,
            rejected=rejected,
            train_loss=self.train_loss if own is not None else None,
            eval_loss=eval_loss,
            bytes_up=self.bytes_up if own is not None else 0,
            bytes_down=down,
            timings=self.timings if own is not None else {},
            mass=mass,
        )
        self.phase, self.pending, self.mass_in = "idle", None, None
        self._log(
            "applied",
            applied_round=r,
            gather=",".join(e.node_id for e in manifest.gather) or "-",
            fingerprint=fp,
            eval_loss=f"{eval_loss:.4f}" if eval_loss is not None else "-",
        )
        try:
            await self.client.report(r, report)
        except CoordinatorError as exc:
            self._log("report_refused", error=exc.error)
        await self.sync.offer(self.w)

    async def _resync(self) -> None:
        """θ differs from the round's base: start again from the newest checkpoint (or θ_0).

        A pending payload trained from the wrong θ goes back into the error buffer first, so
        nothing this node computed is lost; the loop then replays the manifests since.
        """
        if self.pending is not None:
            await self.compute(self.w.return_own, self.pending)
        self.phase, self.pending, self.mass_in = "idle", None, None
        info = await self.sync.restore_latest(self.w)
        if info is None:
            await self.compute(self.w.reset_to_initial)
        await self.compute(self._save_idle)
        self._log("resynced", source=f"checkpoint {info.round}" if info else "θ_0")

    def _after_apply(self) -> tuple[str, float | None, float]:
        """Held-out loss (and its seconds), then fingerprint and the new state on disk."""
        every = self.settings.eval_every
        t0 = time.perf_counter()
        eval_loss = self.w.evaluate() if every and self.w.round % every == 0 else None
        eval_s = time.perf_counter() - t0
        snapshot = self.w.snapshot("idle")
        save_state(self.settings.state_dir, snapshot)
        (self.settings.state_dir / PENDING_FILE).unlink(missing_ok=True)
        return snapshot.fingerprint, eval_loss, eval_s


def run_node(settings: NodeSettings) -> int:
    """Run a node to completion on uvloop; the exit status."""
    import uvloop

    return uvloop.run(NodeDaemon(settings).run())
