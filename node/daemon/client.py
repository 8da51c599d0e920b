"""The coordinator client: ``api.CoordinatorApi`` over HTTP, one typed call per endpoint.

Every request is built from the route table in ``protocol.routes`` (method, path, request and
response models), so no path is typed twice. Each call validates its response with the shared
pydantic models and retries transient failures (connection refused while the coordinator
restarts, 5xx, timeouts) with backoff inside a time budget. A refusal the coordinator means
(401, 404, 409, 422) raises ``CoordinatorError`` at once with the coordinator's error code, so
the round loop can act on it (``round_closed`` means the node missed the round and keeps its
contribution). Every request names this process (``X-Sparseloco-Instance``, a random id per
client), so a second process using the same token is refused instead of taking over; a join
also names the process that ran on the same state directory before (``node.daemon.instance``).
A TLS certificate that does not verify raises ``Refused`` at once (``node.daemon.tls``): it is
not an outage to wait out.

Waiting for the coordinator is done by long-polls, not by asking again and again: the manifest
of an open round (``manifest_wait_s``), and a round that waits for members (``round_wait_s``:
once a ``round()`` answered "waiting", the next asks the coordinator to hold the answer until the
round opens). A coordinator older than the round long-poll refuses the ``wait`` parameter; the
client then asks without it from then on, as before.

Every request also says what the node is doing (``X-Sparseloco-Condition``, from ``say``); a
coordinator that counted it as a heartbeat answers ``X-Sparseloco-Heard``, and ``heard`` tells
the daemon's heartbeat when that last happened, so it beats only into silences. A report is
answered with the round view the node asks for next: the next ``round()`` takes that answer
instead of asking again, if it comes within ``REPORTED_VIEW_S``.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from node.daemon.api import Heard
from node.daemon.retry import FOREVER, TRANSIENT_STATUS, Link, RetryPolicy, retry
from node.daemon.tls import certificate_refused
from node.errors import CoordinatorError, TransientError
from protocol.dataset import DatasetFiles, DatasetFilesRequest, DatasetView
from protocol.messages import (
    CONDITION_HEADER,
    HEARD_HEADER,
    INSTANCE_HEADER,
    CheckpointInfo,
    CheckpointList,
    CheckpointUpload,
    CheckpointView,
    ErrorBody,
    HeartbeatRequest,
    JoinRequest,
    JoinResponse,
    ManifestView,
    NodeCondition,
    ProbeGrant,
    ProbeRequest,
    RoundState,
    RoundView,
    SubmitRequest,
    SubmitResponse,
    UploadGrant,
    UploadRequest,
)
from protocol.parts import PartPlan, UploadComplete, UploadDone
from protocol.reports import RoundReport
from protocol.routes import ROUTES, Endpoint
from protocol.status import StatusView

log = logging.getLogger("sparseloco.client")

M = TypeVar("M", bound=BaseModel)

#: How long the round view a report was answered with stands in for the next ``round()``.
REPORTED_VIEW_S = 1.0


@dataclass(frozen=True)
class ClientTimeouts:
    """Per-request limits, named by phase."""

    connect_s: float = 10.0
    request_s: float = 30.0
    #: Longest server-side wait asked for on the manifest long-poll.
    manifest_wait_s: float = 20.0
    #: Longest server-side wait asked for while a round waits for members; below the daemon's
    #: stop grace (3 s), so a stop requested meanwhile is still taken between two requests.
    round_wait_s: float = 2.5


class CoordinatorClient:
    """Calls the coordinator at ``base_url`` as the node holding ``token``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: str,
        *,
        timeouts: ClientTimeouts | None = None,
        policy: RetryPolicy = FOREVER,
        instance: str | None = None,
        previous_instance: str | None = None,
        on_joined: Callable[[], None] | None = None,
    ) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        #: This process, as the coordinator tells it from another one using the same token.
        self.instance = instance or secrets.token_hex(8)
        #: The process that ran on this node's state directory before (``daemon.instance``).
        self.previous_instance = previous_instance
        #: Called after every successful join: the coordinator now binds the node to this
        #: process (``Instance.bound`` records it for the next restart).
        self.on_joined = on_joined
        self.headers = {"Authorization": f"Bearer {token}", INSTANCE_HEADER: self.instance}
        self.timeouts = timeouts or ClientTimeouts()
        self.policy = policy
        #: Whether the coordinator answers; logs once per change of state, not per attempt.
        self.link = Link(
            "coordinator",
            where=self.base_url,
            hint=f"check the address; `sparseloco doctor --coordinator {self.base_url}` says"
            " what is wrong",
        )
        #: The last round view said "waiting": the next ``round()`` long-polls.
        self._waiting = False
        #: False once the coordinator refused the round long-poll (an older one).
        self._round_long_poll = True
        #: What every request says the node is doing (``say``).
        self._condition: Callable[[], NodeCondition] | None = None
        #: The condition the latest request carried (answered or still in flight: the
        #: coordinator took it as the request arrived), and when the last answer counted as a
        #: heartbeat came (None until one did).
        self._said: NodeCondition | None = None
        self._heard_at: float | None = None
        #: (view, monotonic time) of the last report's answer, for the next ``round()``.
        self._reported: tuple[RoundView, float] | None = None

    def say(self, condition: Callable[[], NodeCondition]) -> None:
        """Carry ``condition()`` on every request from now on."""
        self._condition = condition

    def heard(self) -> Heard | None:
        """What the latest request said, and how long ago the last answer counted as a
        heartbeat came; None if none did (a coordinator that does not count requests, or none
        answered yet)."""
        if self._heard_at is None or self._said is None:
            return None
        return Heard(self._said, time.monotonic() - self._heard_at)

    async def _call(
        self,
        name: str,
        body: BaseModel | None = None,
        *,
        round_: int | None = None,
        params: dict[str, str] | None = None,
        extra_wait_s: float = 0.0,
    ) -> BaseModel:
        """Call endpoint ``name``; the response validated as its model for the status."""
        ep: Endpoint = ROUTES[name]
        path = ep.url(round_)
        timeout = aiohttp.ClientTimeout(
            total=self.timeouts.request_s + extra_wait_s, sock_connect=self.timeouts.connect_s
        )
        data = body.model_dump_json().encode() if body is not None else None
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = "application/json"
        said = self._condition() if self._condition is not None else None
        if said is not None:
            headers[CONDITION_HEADER] = said.value
            self._said = said

        async def attempt() -> BaseModel:
            try:
                return await exchange()
            except aiohttp.ClientConnectorCertificateError as exc:
                # Not an outage: retrying cannot make an untrusted certificate trusted.
                raise certificate_refused(self.base_url, exc) from exc

        async def exchange() -> BaseModel:
            async with self.session.request(
                ep.method,
                self.base_url + path,
                data=data,
                headers=headers,
                params=params,
                timeout=timeout,
            ) as resp:
                raw = await resp.read()
                if resp.status in TRANSIENT_STATUS:
                    code = _error_code(raw)
                    raise TransientError(
                        f"{ep.method} {path}: HTTP {resp.status}" + (f" {code}" if code else ""),
                        resp.status,
                        code,
                    )
                self.link.answered()
                held = resp.headers.get(HEARD_HEADER)
                if said is not None and resp.status < 400 and held is not None:
                    self._heard_at = time.monotonic()
                    with contextlib.suppress(ValueError):  # what the coordinator now holds
                        self._said = NodeCondition(held)
                if resp.status >= 400:
                    try:
                        err = ErrorBody.model_validate_json(raw)
                        raise CoordinatorError(resp.status, err.error, err.message)
                    except ValidationError:
                        raise CoordinatorError(
                            resp.status, "http", raw[:200].decode("utf-8", "replace")
                        ) from None
                model = ep.responses.get(resp.status)
                if model is None:
                    raise CoordinatorError(
                        resp.status, "bad_response", f"{ep.method} {path}: unexpected status"
                    )
                try:
                    return model.model_validate_json(raw)
                except ValidationError as exc:
                    raise CoordinatorError(
                        resp.status, "bad_response", f"{ep.method} {path}: {exc}"
                    ) from exc

        return await retry(attempt, policy=self.policy, what=f"{ep.method} {path}", link=self.link)

    async def join(self, client: str = "") -> JoinResponse:
        request = JoinRequest(
            client=client, instance=self.instance, previous_instance=self.previous_instance
        )
        joined = _as(JoinResponse, await self._call("join", request))
        if self.on_joined is not None:
            self.on_joined()
        return joined

    async def heartbeat(self, condition: NodeCondition | None = None) -> RoundView:
        return _as(RoundView, await self._call("heartbeat", HeartbeatRequest(condition=condition)))

    async def leave(self) -> None:
        await self._call("leave")

    async def round(self) -> RoundView:
        """The round as the coordinator sees this node; held by the coordinator until it opens
        (at most ``round_wait_s``) when the previous answer said it waits for members."""
        reported, self._reported = self._reported, None
        if reported is not None and time.monotonic() - reported[1] < REPORTED_VIEW_S:
            view = reported[0]
            self._waiting = view.state == RoundState.WAITING
            return view
        wait = self.timeouts.round_wait_s
        if self._waiting and self._round_long_poll and wait > 0:
            try:
                out = await self._call("round", params={"wait": f"{wait:g}"}, extra_wait_s=wait)
            except CoordinatorError as exc:
                if exc.status != 422 or "'wait'" not in str(exc):
                    raise
                self._round_long_poll = False  # a coordinator without the round long-poll
                out = await self._call("round")
        else:
            out = await self._call("round")
        view = _as(RoundView, out)
        self._waiting = view.state == RoundState.WAITING
        return view

    async def upload_grant(
        self, round_: int, size: int, sha256: str, parts: PartPlan | None = None
    ) -> UploadGrant:
        request = UploadRequest(size=size, sha256=sha256, parts=parts)
        return _as(UploadGrant, await self._call("upload", request, round_=round_))

    async def upload_complete(self, round_: int, request: UploadComplete) -> UploadDone:
        return _as(UploadDone, await self._call("upload_complete", request, round_=round_))

    async def submit(self, round_: int, request: SubmitRequest) -> SubmitResponse:
        return _as(SubmitResponse, await self._call("submit", request, round_=round_))

    async def manifest(self, round_: int) -> ManifestView | RoundView:
        """The closed round's manifest, or the round's view if it is still open after a wait."""
        wait = self.timeouts.manifest_wait_s
        out = await self._call(
            "manifest", round_=round_, params={"wait": f"{wait:g}"}, extra_wait_s=wait
        )
        if isinstance(out, ManifestView | RoundView):
            return out
        raise TypeError(f"unexpected response type {type(out).__name__}")

    async def report(self, round_: int, report: RoundReport) -> None:
        out = await self._call("report", report, round_=round_)
        if isinstance(out, RoundView):
            self._reported = (out, time.monotonic())

    async def checkpoint_grant(self, round_: int, offer: CheckpointUpload) -> UploadGrant:
        """A presigned PUT for θ_round as a checkpoint; ``CoordinatorError`` ``not_needed``."""
        return _as(UploadGrant, await self._call("checkpoint_upload", offer, round_=round_))

    async def checkpoint_complete(self, round_: int, request: UploadComplete) -> UploadDone:
        """Complete the multipart upload of θ_round; ``CoordinatorError`` ``not_granted``."""
        return _as(UploadDone, await self._call("checkpoint_complete", request, round_=round_))

    async def checkpoint_commit(self, round_: int, offer: CheckpointUpload) -> CheckpointInfo:
        return _as(CheckpointInfo, await self._call("checkpoint_commit", offer, round_=round_))

    async def latest_checkpoint(self) -> CheckpointView | None:
        """The newest accepted checkpoint with a presigned GET, or None if there is none."""
        try:
            out = await self._call("checkpoint_latest")
        except CoordinatorError as exc:
            if exc.status == 404:  # no_checkpoint (or a coordinator without checkpoints)
                return None
            raise
        return _as(CheckpointView, out)

    async def checkpoints(self) -> list[CheckpointView]:
        """Every committed checkpoint still in the store, newest first (empty if none)."""
        out = _as(CheckpointList, await self._call("checkpoints"))
        return out.checkpoints

    async def probe(self, size: int, sha256: str) -> ProbeGrant:
        """A presigned PUT and GET of a throwaway object (``sparseloco doctor``)."""
        return _as(ProbeGrant, await self._call("probe", ProbeRequest(size=size, sha256=sha256)))

    async def dataset(self) -> DatasetView:
        """The run's dataset id and a presigned GET of its manifest."""
        return _as(DatasetView, await self._call("dataset"))

    async def dataset_files(self, names: list[str]) -> DatasetFiles:
        """Presigned GETs for files of the run's dataset."""
        out = await self._call("dataset_files", DatasetFilesRequest(names=names))
        return _as(DatasetFiles, out)

    async def status(self, rounds: int | None = None) -> StatusView:
        params = {"rounds": str(rounds)} if rounds is not None else None
        return _as(StatusView, await self._call("status", params=params))


def _error_code(raw: bytes) -> str | None:
    """The coordinator's error code in an error body (``storage_unavailable``), if it is one."""
    try:
        return ErrorBody.model_validate_json(raw).error
    except ValidationError:
        return None


def _as(model: type[M], value: BaseModel) -> M:
    """``value`` as ``model`` (what the route table promised for the status it came with)."""
    if not isinstance(value, model):
        raise CoordinatorError(0, "bad_response", f"expected {model.__name__}")
    return value
