"""The coordinator's HTTP API (aiohttp): the route handlers and the app's lifecycle.

Handlers are thin: they authenticate the bearer token, validate the body with the wire models of
``protocol.messages``, call the ``RoundMachine`` or the ``CheckpointBook`` (which commit before
we answer), and let ``coordinator.handling`` map every failure to an ``ErrorBody``.

Background tasks (the ticker that times out members and closes overdue rounds, the publisher of
manifests and checkpoint sidecars, and retention) are owned by the app's cleanup context and
cancelled in that order on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web

from coordinator.checkpoints import CheckpointBook
from coordinator.config import CoordinatorConfig
from coordinator.db import DB_FILE, Database
from coordinator.handling import (
    TOKENS,
    ApiError,
    Handler,
    error_middleware,
    node_of,
    ok,
    query_number,
    read_body,
    round_of,
)
from coordinator.machine import Conflict, RoundMachine
from coordinator.metrics import CONTENT_TYPE, CoordinatorMetrics
from coordinator.openapi import ENDPOINTS, openapi_document
from coordinator.publisher import ManifestPublisher
from coordinator.retention import Retention
from coordinator.signing import ManifestSigner
from coordinator.storage import ObjectInfo, ObjectStore, S3Store, sha256_b64
from protocol.keys import payload_key
from protocol.messages import (
    Ack,
    CheckpointUpload,
    CheckpointView,
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


@dataclass
class Coordinator:
    """Everything the handlers share; one per app."""

    config: CoordinatorConfig
    machine: RoundMachine
    checkpoints: CheckpointBook
    store: ObjectStore
    signer: ManifestSigner
    metrics: CoordinatorMetrics
    publisher: ManifestPublisher
    retention: Retention
    tokens: dict[str, str]  # token -> node id
    waiters: dict[int, asyncio.Event] = field(default_factory=dict)
    stopping: bool = False

    def after_close(self, closed: list[SignedManifest]) -> None:
        """Rounds closed: wake their long-polls, count them, publish their manifests, prune."""
        if not closed:
            return
        self.metrics.closed(closed)
        for signed in closed:
            event = self.waiters.pop(signed.manifest.round, None)
            if event is not None:
                event.set()
        self.publisher.kick()
        self.retention.kick()

    async def wait_closed(self, round_: int, timeout: float) -> None:
        """Return when ``round_`` closes, the server stops, or after ``timeout`` seconds."""
        if self.stopping or timeout <= 0:
            return
        event = self.waiters.setdefault(round_, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)


COORDINATOR = web.AppKey("coordinator", Coordinator)


def _matches(info: ObjectInfo | None, size: int, sha256: str) -> bool:
    """Whether a stored object has this size and (if the store keeps one) this checksum."""
    return (
        info is not None
        and info.size == size
        and (info.sha256_b64 is None or info.sha256_b64 == sha256_b64(sha256))
    )


# ---- handlers ------------------------------------------------------------------------------
async def join(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    req = await read_body(request, JoinRequest)
    slot = coord.machine.join(node_id, req.client)
    timing = coord.config.run.timing
    return ok(
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
    return ok(request.app[COORDINATOR].machine.heartbeat(node_of(request)))


async def leave(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    coord.after_close(coord.machine.leave(node_of(request)))
    return ok(Ack())


async def current_round(request: web.Request) -> web.Response:
    return ok(request.app[COORDINATOR].machine.round_view(node_of(request)))


def _check_size(coord: Coordinator, size: int) -> None:
    limit = coord.config.storage.max_payload_bytes
    if size > limit:
        raise ApiError(413, "too_large", f"size {size} exceeds the run's limit {limit}", "size")


async def upload(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    round_ = round_of(request)
    req = await read_body(request, UploadRequest)
    _check_size(coord, req.size)
    coord.machine.check_submittable(node_id, round_)
    key = payload_key(coord.config.storage.prefix, coord.machine.run_id, round_, node_id)
    url, headers = coord.store.presign_put(key, req.size, req.sha256)
    log.info("event=upload_granted round=%d node=%s size=%d", round_, node_id, req.size)
    expires = float(coord.config.server.presign_expiry_s)
    return ok(UploadGrant(key=key, url=url, headers=headers, expires_in_s=expires))


async def submit(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    round_ = round_of(request)
    req = await read_body(request, SubmitRequest)
    _check_size(coord, req.size)
    prior = coord.machine.previous_submission(node_id, round_, req)
    if prior is not None:
        return ok(prior)
    coord.machine.check_submittable(node_id, round_)
    key = payload_key(coord.config.storage.prefix, coord.machine.run_id, round_, node_id)
    digest_ok = _matches(await coord.store.head(key), req.size, req.sha256)
    resp, closed = coord.machine.submit(node_id, round_, req, digest_ok)
    coord.metrics.submissions.labels(result=resp.reason or "accepted").inc()
    coord.after_close(closed)
    return ok(resp)


async def manifest(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    round_ = round_of(request)
    server = coord.config.server
    wait = min(query_number(request, "wait", 0.0, 1e9), server.manifest_wait_max_s)
    signed = coord.machine.manifest(round_)
    if signed is None:
        await coord.wait_closed(round_, wait)
        signed = coord.machine.manifest(round_)
    if signed is None:
        return ok(coord.machine.round_view(node_id), status=202)
    urls = {e.node_id: coord.store.presign_get(e.key) for e in signed.manifest.gather}
    return ok(ManifestView(signed=signed, urls=urls))


async def report(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    round_ = round_of(request)
    body = await read_body(request, RoundReport)
    coord.machine.report(node_id, round_, body)
    return ok(Ack())


async def status(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    default = coord.config.server.status_rounds
    n = int(query_number(request, "rounds", default, 100000))
    return ok(coord.machine.status(n))


async def checkpoint_upload(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    round_ = round_of(request)
    offer = await read_body(request, CheckpointUpload)
    key = coord.checkpoints.grant(node_id, round_, offer)
    # An expired grant (another node's, or this node's for other bytes) may have left an object
    # behind; the key is write-once, so it must go unless it surely holds exactly these bytes
    # (a store that keeps no checksum cannot say: same-shaped checkpoints have equal sizes).
    stored = await coord.store.head(key)
    if stored is not None and stored.sha256_b64 != sha256_b64(offer.sha256):
        await coord.store.delete_keys([key])
        log.info("event=checkpoint_stale_deleted round=%d node=%s", round_, node_id)
    url, headers = coord.store.presign_put(key, offer.size, offer.sha256)
    expires = float(coord.config.server.presign_expiry_s)
    return ok(UploadGrant(key=key, url=url, headers=headers, expires_in_s=expires))


async def checkpoint_commit(request: web.Request) -> web.Response:
    """Commit an uploaded checkpoint, answering once its sidecar and ``latest.json`` are written.

    The stored object is checked by HEAD (size and checksum), never downloaded; a node that loads
    the checkpoint verifies the fingerprint of what it loaded. If the store fails after the
    checkpoint is recorded, the answer is 503: the publisher keeps retrying in the background, and
    a retried commit (idempotent) answers once everything is written.
    """
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    round_ = round_of(request)
    offer = await read_body(request, CheckpointUpload)
    info = coord.checkpoints.committed(node_id, round_, offer)
    if info is None:
        stored = await coord.store.head(coord.checkpoints.key(round_))
        if not _matches(stored, offer.size, offer.sha256):
            raise Conflict(
                "missing", f"no object with this size and sha256 at the checkpoint of {round_}"
            )
        info = coord.checkpoints.commit(node_id, round_, offer)
        coord.metrics.checkpoints.inc()
        coord.retention.kick()
    try:
        await coord.publisher.publish_checkpoints()
    except Exception:
        coord.publisher.kick()
        raise
    return ok(info)


async def checkpoint_latest(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_of(request)
    info = coord.checkpoints.latest()
    if info is None:
        raise ApiError(404, "no_checkpoint", "no checkpoint has been committed yet")
    return ok(CheckpointView(info=info, url=coord.store.presign_get(info.key)))


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
    "checkpoint_upload": checkpoint_upload,
    "checkpoint_commit": checkpoint_commit,
    "checkpoint_latest": checkpoint_latest,
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
    retention = asyncio.create_task(coord.retention.run_forever(), name="retention")
    yield
    for task in (ticker, publisher, retention):
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
    book = CheckpointBook(
        machine,
        prefix=storage.prefix,
        grant_s=config.server.presign_expiry_s,
        max_bytes=storage.max_checkpoint_bytes,
    )
    retention = Retention(
        db,
        store,
        config.run,
        prefix=storage.prefix,
        current_round=machine.round_number,
        metrics=metrics_,
    )
    coord = Coordinator(
        config=config,
        machine=machine,
        checkpoints=book,
        store=store,
        signer=signer,
        metrics=metrics_,
        publisher=publisher,
        retention=retention,
        tokens=config.node_for_token(),
    )
    app = web.Application(
        middlewares=[error_middleware], client_max_size=config.server.max_body_bytes
    )
    app[COORDINATOR] = coord
    app[TOKENS] = coord.tokens
    for ep in ENDPOINTS:
        path = ep.path.replace("{round}", r"{round:\d{1,18}}")
        app.router.add_route(ep.method, path, HANDLERS[ep.name])
    app.on_shutdown.append(_release_waiters)
    app.cleanup_ctx.append(_background)
    return app
