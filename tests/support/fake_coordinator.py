"""An in-memory coordinator behind the node's ``CoordinatorApi`` seam, with the real rules.

``FakeCoordinator`` drives the coordinator's own round state machine, membership and checkpoint
book (``coordinator.rules.machine``, ``coordinator.rules.checkpoints``; SQLite in a temporary
directory, manifests signed by a real key), but without HTTP: each node gets a ``FakeApi`` whose
coroutines call the machine directly and turn its refusals into the ``CoordinatorError`` the HTTP
client would raise. Time is a ``FakeClock``: rounds close when every expected node submitted, or
when a test advances the clock past the deadline. Uploads and downloads go through a ``FakeStore``.

So the unit tests run the real ``NodeDaemon`` against the real round rules, in one process,
with no socket and no sleep on the wall clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path

from coordinator.base.errors import Conflict, RoundError, TooLarge, UnknownRound
from coordinator.rules.checkpoints import CheckpointBook
from coordinator.rules.machine import RoundMachine
from coordinator.state.db import Database
from coordinator.state.schema import DB_FILE
from coordinator.state.signing import ManifestSigner
from node.daemon.api import Heard
from node.errors import CoordinatorError
from protocol.dataset import DatasetFiles, DatasetView
from protocol.keys import payload_key
from protocol.messages import (
    CheckpointInfo,
    CheckpointUpload,
    CheckpointView,
    JoinResponse,
    ManifestView,
    NodeCondition,
    RoundView,
    SignedManifest,
    SubmitRequest,
    SubmitResponse,
    UploadGrant,
)
from protocol.parts import PartPlan, UploadComplete, UploadDone
from protocol.reports import RoundReport
from protocol.runconfig import RunConfig
from support.fake_store import FakeClock, FakeStore

#: Real seconds a manifest request waits for its round to close before answering 202.
LONG_POLL_S = 0.05


class FakeCoordinator:
    """One run's coordinator state, shared by every node's ``FakeApi``."""

    def __init__(self, run: RunConfig, state_dir: Path, store: FakeStore, clock: FakeClock):
        state_dir.mkdir(parents=True, exist_ok=True)
        self.run = run
        self.store = store
        self.clock = clock
        self.db = Database(state_dir / DB_FILE)
        self.signer = ManifestSigner.load_or_create(state_dir)
        self.machine = RoundMachine(self.db, run, self.signer, clock=clock.wall)
        self.book = CheckpointBook(
            self.db,
            run,
            current_round=self.machine.round_number,
            prefix="",
            grant_s=900.0,
            max_bytes=1 << 30,
            clock=clock.wall,
        )
        self._closed = asyncio.Event()
        #: Every call, in order: (node, endpoint, round or None).
        self.calls: list[tuple[str, str, int | None]] = []
        #: Cleared during an outage: every call waits, as the real client retrying would.
        self.reachable = asyncio.Event()
        self.reachable.set()
        #: Calls waiting for the coordinator to come back.
        self.waiting = 0
        #: Tokens refused for good (401 token_revoked), by node.
        self.revoked: set[str] = set()
        #: Joins still to refuse with 409 token_in_use, by node.
        self.in_use: dict[str, int] = {}
        #: A manifest key (hex) joins hand out instead of the signer's: a man in the middle
        #: swapping the trust anchor. None: the real one.
        self.join_key: str | None = None
        #: Rewrites every closed round's signed manifest on its way to the nodes (a man in the
        #: middle forging gather sets). None: manifests pass as signed.
        self.forge: Callable[[SignedManifest], SignedManifest] | None = None

    def outage(self) -> None:
        """The coordinator stops answering until ``restore``."""
        self.reachable.clear()

    def restore(self) -> None:
        self.reachable.set()

    def api(self, node_id: str) -> FakeApi:
        return FakeApi(self, node_id)

    @property
    def public_key(self) -> str:
        return self.signer.public_key_hex

    def after(self, closed: list[SignedManifest]) -> None:
        """State changed: wake long-polls and sleeping nodes."""
        if closed:
            self._closed.set()
            self._closed = asyncio.Event()
        self.clock.kick()

    def advance(self, seconds: float) -> None:
        """Let fake time pass, then let the machine act on it (timeouts, deadlines)."""
        self.clock.t += seconds
        self.after(self.machine.tick())

    async def wait_closed(self) -> None:
        await asyncio.wait_for(self._closed.wait(), LONG_POLL_S)

    def close(self) -> None:
        self.db.close()


def _refusal(exc: RoundError) -> CoordinatorError:
    """The error the HTTP client raises for what the coordinator would answer."""
    status = 404 if isinstance(exc, UnknownRound) else 413 if isinstance(exc, TooLarge) else 409
    return CoordinatorError(status, exc.code, exc.message)


class FakeApi:
    """``node.daemon.api.CoordinatorApi`` for one node of a ``FakeCoordinator``."""

    def __init__(self, coord: FakeCoordinator, node_id: str) -> None:
        self.c = coord
        self.node_id = node_id
        #: Reports this node sent, by round.
        self.reports: dict[int, RoundReport] = {}
        #: What every call says the node is doing (``say``), and the last call that counted
        #: as a heartbeat (condition, fake time), as the real coordinator counts them.
        self._condition: Callable[[], NodeCondition] | None = None
        self._heard: tuple[NodeCondition, float] | None = None

    def say(self, condition: Callable[[], NodeCondition]) -> None:
        self._condition = condition

    def heard(self) -> Heard | None:
        if self._heard is None:
            return None
        return Heard(self._heard[0], self.c.clock.now() - self._heard[1])

    def _note(self, endpoint: str, round_: int | None = None) -> None:
        self.c.calls.append((self.node_id, endpoint, round_))

    async def _reach(self) -> None:
        """Wait out an outage; then refuse a revoked token as the real coordinator would."""
        await asyncio.sleep(0)
        if not self.c.reachable.is_set():
            self.c.waiting += 1
            try:
                await self.c.reachable.wait()
            finally:
                self.c.waiting -= 1
        if self.node_id in self.c.revoked:
            raise CoordinatorError(401, "token_revoked", "this node's token was revoked")
        said = self._condition() if self._condition is not None else None
        if said is not None and self.c.machine.heard(self.node_id, said):
            self._heard = (said, self.c.clock.now())  # no wire: said and answered at once

    async def join(self, client: str = "") -> JoinResponse:
        await self._reach()
        self._note("join")
        if self.c.in_use.get(self.node_id, 0) > 0:
            self.c.in_use[self.node_id] -= 1
            raise CoordinatorError(409, "token_in_use", "another process is using this token")
        m = self.c.machine
        try:
            slot = m.join(self.node_id, client)
        except RoundError as exc:
            raise _refusal(exc) from exc
        self.c.after(m.tick())
        return JoinResponse(
            node_id=self.node_id,
            run_id=m.run_id,
            run=self.c.run,
            slot=slot,
            manifest_public_key=self.c.join_key or self.c.public_key,
            heartbeat_interval_s=self.c.run.timing.heartbeat_timeout_s / 4,
            round=m.round_view(self.node_id),
        )

    async def heartbeat(self, condition: NodeCondition | None = None) -> RoundView:
        self._note("heartbeat")
        await self._reach()
        try:
            return self.c.machine.heartbeat(self.node_id, condition)
        except RoundError as exc:
            raise _refusal(exc) from exc

    async def leave(self) -> None:
        await self._reach()
        self._note("leave")
        try:
            self.c.after(self.c.machine.leave(self.node_id))
        except RoundError as exc:
            raise _refusal(exc) from exc

    async def round(self) -> RoundView:
        await self._reach()
        self._note("round")
        return self.c.machine.round_view(self.node_id)

    async def upload_grant(
        self, round_: int, size: int, sha256: str, parts: PartPlan | None = None
    ) -> UploadGrant:
        """A single PUT whatever ``parts`` asks (as a coordinator whose store has no multipart
        uploads answers)."""
        await self._reach()
        self._note("upload", round_)
        try:
            self.c.machine.check_submittable(self.node_id, round_)
        except RoundError as exc:
            raise _refusal(exc) from exc
        key = payload_key("", self.c.machine.run_id, round_, self.node_id)
        url = self.c.store.presign_put(key, size, sha256)
        return UploadGrant(key=key, url=url, headers={}, expires_in_s=900.0)

    async def upload_complete(self, round_: int, request: UploadComplete) -> UploadDone:
        await self._reach()
        raise CoordinatorError(409, "no_multipart", "this fake grants single PUTs only")

    async def submit(self, round_: int, request: SubmitRequest) -> SubmitResponse:
        await self._reach()
        self._note("submit", round_)
        m = self.c.machine
        try:
            prior = m.previous_submission(self.node_id, round_, request)
            if prior is not None:
                return prior
            m.check_submittable(self.node_id, round_)
            key = payload_key("", m.run_id, round_, self.node_id)
            digest_ok = self.c.store.matches(key, request.size, request.sha256)
            response, closed = m.submit(self.node_id, round_, request, digest_ok)
        except RoundError as exc:
            raise _refusal(exc) from exc
        self.c.after(closed)
        return response

    async def manifest(self, round_: int) -> ManifestView | RoundView:
        await self._reach()
        m = self.c.machine
        try:
            signed = m.manifest(round_)
            if signed is None:
                with contextlib.suppress(TimeoutError):
                    await self.c.wait_closed()
                signed = m.manifest(round_)
        except RoundError as exc:
            raise _refusal(exc) from exc
        if signed is None:
            return m.round_view(self.node_id)
        if self.c.forge is not None:
            signed = self.c.forge(signed)
        urls = {e.node_id: self.c.store.presign_get(e.key) for e in signed.manifest.gather}
        return ManifestView(signed=signed, urls=urls)

    async def report(self, round_: int, report: RoundReport) -> None:
        await self._reach()
        self._note("report", round_)
        try:
            self.c.machine.report(self.node_id, round_, report)
        except RoundError as exc:
            raise _refusal(exc) from exc
        self.reports.setdefault(round_, report)

    async def checkpoint_grant(self, round_: int, offer: CheckpointUpload) -> UploadGrant:
        await self._reach()
        try:
            key = self.c.book.grant(self.node_id, round_, offer)
        except RoundError as exc:
            raise _refusal(exc) from exc
        self.c.store.objects.pop(key, None)  # a stale object from an expired grant goes
        url = self.c.store.presign_put(key, offer.size, offer.sha256)
        return UploadGrant(key=key, url=url, headers={}, expires_in_s=900.0)

    async def checkpoint_complete(self, round_: int, request: UploadComplete) -> UploadDone:
        await self._reach()
        raise CoordinatorError(409, "no_multipart", "this fake grants single PUTs only")

    async def checkpoint_commit(self, round_: int, offer: CheckpointUpload) -> CheckpointInfo:
        await self._reach()
        book = self.c.book
        try:
            info = book.committed(self.node_id, round_, offer)
            if info is None:
                if not self.c.store.matches(book.key(round_), offer.size, offer.sha256):
                    raise Conflict("missing", f"no checkpoint object for round {round_}")
                info = book.commit(self.node_id, round_, offer)
        except RoundError as exc:
            raise _refusal(exc) from exc
        return info

    async def checkpoints(self) -> list[CheckpointView]:
        await self._reach()
        return [
            CheckpointView(info=info, url=self.c.store.presign_get(info.key))
            for info in self.c.book.listed()
        ]

    async def dataset(self) -> DatasetView:
        await self._reach()
        raise CoordinatorError(404, "no_dataset", "the fake coordinator's runs use local data")

    async def dataset_files(self, names: list[str]) -> DatasetFiles:
        await self._reach()
        raise CoordinatorError(404, "no_dataset", "the fake coordinator's runs use local data")
