"""The coordinator's HTTP API (aiohttp): authentication, validation, routes, error mapping.

Handlers are thin: they authenticate the bearer token, validate the body with the wire models of
``protocol.messages``, call the ``RoundMachine`` (which commits before we answer), and map every
failure to an ``ErrorBody``::

    400 bad_json      body is not JSON             401 unauthorized   no or unknown token
    404 unknown_round / not_found                  409 round_closed, round_open, not_expected,
    413 too_large     body or payload too big          not_member, already_submitted
    422 invalid       validation failed (field = dotted location of the first error)
    503 storage_unavailable                        the object store did not answer

Background tasks (the ticker that times out members and closes overdue rounds, and the manifest
publisher) are owned by the app's cleanup context and cancelled in that order on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from coordinator.config import CoordinatorConfig
from coordinator.db import DB_FILE, Database
from coordinator.machine import RoundError, RoundMachine, UnknownRound
from coordinator.metrics import CONTENT_TYPE, CoordinatorMetrics
from coordinator.openapi import ENDPOINTS, openapi_document
from coordinator.publisher import ManifestPublisher
from coordinator.signing import ManifestSigner
from coordinator.storage import ObjectStore, S3Store, StorageError, sha256_b64
from protocol.errors import SparseLoCoError
from protocol.keys import payload_key
from protocol.messages import (
    Ack,
    ErrorBody,
    JoinRequest,
    JoinResponse,
    ManifestView,
    RoundReport,
    SignedManifest,
    SubmitRequest,
    UploadGrant,
    UploadRequest,
)

log = logging.getLogger("sparseloco.coordinator.app")

#: Seconds between ticks (member timeouts, waiting rounds opening, deadlines).
TICK_S = 0.25
M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(SparseLoCoError):
    """An error answered as ``ErrorBody`` with an HTTP status."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field


@dataclass
class Coordinator:
    """Everything the handlers share; one per app."""

    config: CoordinatorConfig
    machine: RoundMachine
    store: ObjectStore
    signer: ManifestSigner
    metrics: CoordinatorMetrics
    publisher: ManifestPublisher
    tokens: dict[str, str]  # token -> node id
    waiters: dict[int, asyncio.Event] = field(default_factory=dict)
    stopping: bool = False

    def after_close(self, closed: list[SignedManifest]) -> None:
        """Rounds closed: wake their long-polls, count them, publish their manifests."""
        if not closed:
            return
        self.metrics.closed(closed)
        for signed in closed:
            event = self.waiters.pop(signed.manifest.round, None)
            if event is not None:
                event.set()
        self.publisher.kick()

    async def wait_closed(self, round_: int, timeout: float) -> None:
        """Return when ``round_`` closes, the server stops, or after ``timeout`` seconds."""
        if self.stopping or timeout <= 0:
            return
        event = self.waiters.setdefault(round_, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)


COORDINATOR = web.AppKey("coordinator", Coordinator)


def _error(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    body = ErrorBody(error=code, message=message, field=field)
    return web.json_response(text=body.model_dump_json(), status=status)


def _ok(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return _error(exc.status, exc.code, exc.message, exc.field)
    except UnknownRound as exc:
        return _error(404, exc.code, exc.message)
    except RoundError as exc:
        return _error(409, exc.code, exc.message)
    except web.HTTPRequestEntityTooLarge as exc:
        return _error(413, "too_large", exc.text or "request body too large")
    except StorageError as exc:
        log.warning("event=storage_error path=%s error=%s", request.path, exc)
        return _error(503, "storage_unavailable", f"the object store failed: {exc}")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return _error(exc.status, code, exc.reason)


def _node(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    node_id = request.app[COORDINATOR].tokens.get(token.strip()) if scheme == "Bearer" else None
    if node_id is None:
        raise ApiError(401, "unauthorized", "send Authorization: Bearer <token> from the config")
    return node_id


async def _body(request: web.Request, model: type[M]) -> M:
    raw = await request.read()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, "bad_json", f"the body is not valid JSON: {first['msg']}") from exc
        loc = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(422, "invalid", f"{loc or 'body'}: {first['msg']}", loc) from exc


def _round(request: web.Request) -> int:
    return int(request.match_info["round"])


def _query_number(request: web.Request, name: str, default: float, hi: float) -> float:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= hi:
        raise ApiError(422, "invalid", f"{name} must be a number in [0, {hi:g}]", name)
    return value


# ---- handlers ------------------------------------------------------------------------------
async def join(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = _node(request)
    req = await _body(request, JoinRequest)
    slot = coord.machine.join(node_id, req.client)
    timing = coord.config.run.timing
    return _ok(
        JoinResponse(
            node_id=node_id,
            run_id=coord.machine.run_id,
            run=coord.config.run,
            slot=slot,
            manifest_public_key=coord.signer.public_key_hex,
            heartbeat_interval_s=timing.heartbeat_timeout_s / 4,
            round=coord.machine.round_view(node_id),
        )
    )


async def heartbeat(request: web.Request) -> web.Response:
    return _ok(request.app[COORDINATOR].machine.heartbeat(_node(request)))


async def leave(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    coord.after_close(coord.machine.leave(_node(request)))
    return _ok(Ack())


async def current_round(request: web.Request) -> web.Response:
    return _ok(request.app[COORDINATOR].machine.round_view(_node(request)))


def _check_size(coord: Coordinator, size: int) -> None:
    limit = coord.config.storage.max_payload_bytes
    if size > limit:
        raise ApiError(413, "too_large", f"size {size} exceeds the run's limit {limit}", "size")


async def upload(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = _node(request)
    round_ = _round(request)
    req = await _body(request, UploadRequest)
    _check_size(coord, req.size)
    coord.machine.check_submittable(node_id, round_)
    key = payload_key(coord.config.storage.prefix, coord.machine.run_id, round_, node_id)
    url, headers = coord.store.presign_put(key, req.size, req.sha256)
    log.info("event=upload_granted round=%d node=%s size=%d", round_, node_id, req.size)
    expires = float(coord.config.server.presign_expiry_s)
    return _ok(UploadGrant(key=key, url=url, headers=headers, expires_in_s=expires))


async def submit(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = _node(request)
    round_ = _round(request)
    req = await _body(request, SubmitRequest)
    _check_size(coord, req.size)
    prior = coord.machine.previous_submission(node_id, round_, req)
    if prior is not None:
        return _ok(prior)
    coord.machine.check_submittable(node_id, round_)
    key = payload_key(coord.config.storage.prefix, coord.machine.run_id, round_, node_id)
    info = await coord.store.head(key)
    digest_ok = (
        info is not None
        and info.size == req.size
        and (info.sha256_b64 is None or info.sha256_b64 == sha256_b64(req.sha256))
    )
    resp, closed = coord.machine.submit(node_id, round_, req, digest_ok)
    coord.metrics.submissions.labels(result=resp.reason or "accepted").inc()
    coord.after_close(closed)
    return _ok(resp)


async def manifest(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = _node(request)
    round_ = _round(request)
    server = coord.config.server
    wait = min(_query_number(request, "wait", 0.0, 1e9), server.manifest_wait_max_s)
    signed = coord.machine.manifest(round_)
    if signed is None:
        await coord.wait_closed(round_, wait)
        signed = coord.machine.manifest(round_)
    if signed is None:
        return _ok(coord.machine.round_view(node_id), status=202)
    urls = {e.node_id: coord.store.presign_get(e.key) for e in signed.manifest.gather}
    return _ok(ManifestView(signed=signed, urls=urls))


async def report(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = _node(request)
    round_ = _round(request)
    body = await _body(request, RoundReport)
    coord.machine.report(node_id, round_, body)
    return _ok(Ack())


async def status(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    default = coord.config.server.status_rounds
    n = int(_query_number(request, "rounds", default, 100000))
    return _ok(coord.machine.status(n))


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def metrics(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    coord.metrics.set_members(m.state for m in coord.machine.db.members())
    coord.metrics.round.set(coord.machine.round_number())
    return web.Response(body=coord.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


HANDLERS: dict[str, Handler] = {
    "join": join,
    "heartbeat": heartbeat,
    "leave": leave,
    "round": current_round,
    "upload": upload,
    "submit": submit,
    "manifest": manifest,
    "report": report,
    "status": status,
    "openapi": openapi,
    "metrics": metrics,
}


# ---- lifecycle -----------------------------------------------------------------------------
async def _ticker(coord: Coordinator) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        try:
            coord.after_close(coord.machine.tick())
        except Exception:  # one bad tick must not stop timeouts and deadlines for good
            log.exception("event=tick_failed")


async def _background(app: web.Application) -> AsyncIterator[None]:
    coord = app[COORDINATOR]
    ticker = asyncio.create_task(_ticker(coord), name="ticker")
    publisher = asyncio.create_task(coord.publisher.run(), name="publisher")
    yield
    for task in (ticker, publisher):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    coord.machine.db.close()
    log.info("event=background_stopped")


async def _release_waiters(app: web.Application) -> None:
    coord = app[COORDINATOR]
    coord.stopping = True
    for event in coord.waiters.values():
        event.set()


def create_app(
    config: CoordinatorConfig,
    *,
    store: ObjectStore | None = None,
    clock: Callable[[], float] = time.time,
) -> web.Application:
    """Open (or create) the state in ``config.server.state_dir`` and build the app.

    Raises ``ConfigError`` if the state directory belongs to another run.
    """
    state_dir = config.server.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    storage = config.storage
    if store is None:
        store = S3Store(
            endpoint_url=storage.endpoint_url,
            bucket=storage.bucket,
            access_key=storage.access_key,
            secret_key=storage.secret_key,
            region=storage.region,
            expiry_s=config.server.presign_expiry_s,
        )
    db = Database(state_dir / DB_FILE)
    signer = ManifestSigner.load_or_create(state_dir)
    try:
        machine = RoundMachine(db, config.run, signer, prefix=storage.prefix, clock=clock)
    except BaseException:
        db.close()
        raise
    metrics_ = CoordinatorMetrics()
    publisher = ManifestPublisher(
        db, store, prefix=storage.prefix, run_id=machine.run_id, metrics=metrics_
    )
    coord = Coordinator(
        config=config,
        machine=machine,
        store=store,
        signer=signer,
        metrics=metrics_,
        publisher=publisher,
        tokens=config.node_for_token(),
    )
    app = web.Application(
        middlewares=[error_middleware], client_max_size=config.server.max_body_bytes
    )
    app[COORDINATOR] = coord
    for ep in ENDPOINTS:
        path = ep.path.replace("{round}", r"{round:\d{1,18}}")
        app.router.add_route(ep.method, path, HANDLERS[ep.name])
    app.on_shutdown.append(_release_waiters)
    app.cleanup_ctx.append(_background)
    return app
