"""The coordinator's route handlers, and the table that names them for ``protocol.routes``.

Handlers are thin: they authenticate the bearer token, validate the body with the wire models of
``protocol.messages``, call the ``RoundMachine`` or the ``CheckpointBook`` (which commit before
we answer), and let ``coordinator.api.handling`` map every failure to an ``ErrorBody``. The object
store calls (presigning, HEAD checks, reading back a checkpoint to verify it) happen here,
around the synchronous state changes.
``HANDLERS`` has one entry per endpoint name; ``coordinator.api.app`` registers them by that name.

The dashboard (``GET /`` and its script and style sheet) is three static files shipped as package
data in ``coordinator/api/dashboard/``; the page itself polls ``GET /v1/status``, so it needs
nothing else from the coordinator. Its headers allow only this origin's own files to load or run.
"""

from __future__ import annotations

import functools
import logging
from importlib import resources

from aiohttp import web

from coordinator.api.confirm import matches
from coordinator.api.handling import (
    Handler,
    heard_again,
    instance_of,
    node_of,
    ok,
    query_value,
    read_body,
    round_of,
    round_request,
)
from coordinator.api.openapi import openapi_document
from coordinator.api.service import COORDINATOR
from coordinator.api.uploads import (
    check_size,
    checkpoint_complete,
    grant,
    own_payload_key,
    upload,
    upload_complete,
)
from coordinator.base.errors import ApiError, BadCheckpoint, Conflict
from coordinator.monitoring.metrics import CONTENT_TYPE
from coordinator.monitoring.status import build_status
from coordinator.store.object_store import sha256_b64
from protocol.dataset import MANIFEST_FILE, DatasetFiles, DatasetFilesRequest, DatasetView
from protocol.keys import probe_key
from protocol.messages import (
    Ack,
    CheckpointList,
    CheckpointUpload,
    CheckpointView,
    HeartbeatRequest,
    JoinRequest,
    JoinResponse,
    NodeCondition,
    ProbeGrant,
    ProbeRequest,
    RoundState,
    SubmitRequest,
)
from protocol.parts import composite_sha256_b64
from protocol.reports import RoundReport
from protocol.routes import MAX_STATUS_ROUNDS, ROUTES

log = logging.getLogger("sparseloco.coordinator.app")


async def join(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = node_of(request, bound=False)  # the join checks the process, with its body
    req = await read_body(request, JoinRequest)
    instance = req.instance or instance_of(request)
    slot = coord.machine.join(node_id, req.client, instance, req.previous_instance)
    coord.wake_opened()
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
    node_id = node_of(request)
    body = await read_body(request, HeartbeatRequest, optional=True)
    return ok(request.app[COORDINATOR].machine.heartbeat(node_id, body.condition))


async def leave(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    coord.after_close(coord.machine.leave(node_of(request)))
    return ok(Ack())


async def current_round(request: web.Request) -> web.Response:
    """The round as the caller sees it; with ``wait``, a round still waiting for members is
    long-polled until it opens (at most ``manifest_wait_max_s``), so nodes need not poll."""
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    wait = query_value(request, "wait", ROUTES["round"].query["wait"], 0.0)
    view = coord.machine.round_view(node_id)
    if view.state == RoundState.WAITING and wait > 0:
        await coord.wait_opened(view.round, min(wait, coord.config.server.manifest_wait_max_s))
        view = coord.machine.round_view(node_id)
    return ok(view)


async def submit(request: web.Request) -> web.Response:
    coord, node_id, round_, req = await round_request(request, SubmitRequest)
    check_size(coord, req.size)
    inner_steps = coord.machine.run.inner_steps
    if req.steps is not None and req.steps > inner_steps:
        raise ApiError(
            422,
            "bad_request",
            f"steps={req.steps} exceeds the run's inner_steps={inner_steps}: a round has at"
            " most H inner steps",
            "steps",
        )
    prior = coord.machine.previous_submission(node_id, round_, req)
    if prior is not None:
        return ok(prior)
    key = own_payload_key(coord, node_id, round_, req.sha256)
    digest_ok: bool | None = None  # the only payload granted here: confirmed before the close
    if not coord.machine.checks.trusts(round_, node_id, req.sha256, req.size):
        digest_ok = matches(await coord.store.head(key), req.size, req.sha256)
    resp, closed = coord.machine.submit(node_id, round_, req, digest_ok)
    coord.metrics.submissions.labels(result=resp.reason or "accepted").inc()
    coord.after_close(closed)
    return ok(resp)


async def manifest(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    round_ = round_of(request)
    server = coord.config.server
    wait = query_value(request, "wait", ROUTES["manifest"].query["wait"], 0.0)
    wait = min(wait, server.manifest_wait_max_s)
    body = coord.manifest_body(round_)
    if body is None:
        await coord.wait_closed(round_, wait)
        body = coord.manifest_body(round_)
    if body is None:
        return ok(coord.machine.round_view(node_id), status=202)
    heard_again(request, node_id, NodeCondition.TRAINING)  # it applies the round, then trains
    return web.Response(body=body, content_type="application/json")


async def report(request: web.Request) -> web.Response:
    coord, node_id, round_, body = await round_request(request, RoundReport)
    if coord.machine.report(node_id, round_, body):
        coord.metrics.nodes.observe(node_id, round_, body)
    return ok(coord.machine.round_view(node_id))  # the node's next question, answered now


async def status(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    spec = ROUTES["status"].query["rounds"]
    default = min(coord.config.server.status_rounds, MAX_STATUS_ROUNDS)
    n = int(query_value(request, "rounds", spec, default))
    machine = coord.machine
    view = build_status(
        machine.db,
        machine.run,
        last_seen=machine.members.last_seen,
        now=machine.clock(),
        n_rounds=n,
        conditions=machine.members.conditions,
    )
    return ok(view)


async def checkpoint_upload(request: web.Request) -> web.Response:
    coord, node_id, round_, offer = await round_request(request, CheckpointUpload)
    key = coord.checkpoints.grant(node_id, round_, offer)
    # An expired grant (another node's, or this node's for other bytes) may have left an object
    # behind; the key is write-once, so it must go unless it surely holds exactly these bytes
    # (a store that keeps no checksum cannot say: same-shaped checkpoints have equal sizes).
    # An object uploaded in parts keeps the digest of its parts' digests (``protocol.parts``).
    same = {sha256_b64(offer.sha256)}
    if offer.parts is not None:
        same.add(composite_sha256_b64(offer.parts.sha256))
    stored = await coord.store.head(key)
    if stored is not None and stored.sha256_b64 not in same:
        await coord.store.delete_keys([key])
        log.info("event=checkpoint_stale_deleted round=%d node=%s", round_, node_id)
    return ok(await grant(coord, key, offer.size, offer.sha256, offer.parts))


async def checkpoint_commit(request: web.Request) -> web.Response:
    """Commit an uploaded checkpoint once it is verified, answering once its sidecar and
    ``latest.json`` are written.

    The offer must still be the participants' majority; the stored object is checked by HEAD
    (size and checksum), then read back and verified (``coordinator.store.verify``: size, sha256,
    the fingerprint of its tensors). A file that fails is deleted, the grant dropped so another node
    may offer, and the answer is 409 ``bad_checkpoint``. If the store fails after the checkpoint
    is recorded, the answer is 503: the publisher keeps retrying in the background, and a retried
    commit (idempotent) answers once everything is written.
    """
    coord, node_id, round_, offer = await round_request(request, CheckpointUpload)
    book = coord.checkpoints
    info = book.committed(node_id, round_, offer)
    if info is None:
        book.check_offer(round_, offer)
        key = book.key(round_)
        stored = await coord.store.head(key)
        if not matches(stored, offer.size, offer.sha256):
            raise Conflict(
                "missing", f"no object with this size and sha256 at the checkpoint of {round_}"
            )
        try:
            await coord.verifier.verify(key, offer)
        except BadCheckpoint as exc:
            await coord.store.delete_keys([key])
            book.reject(node_id, round_, exc.message)
            raise
        info = book.commit(node_id, round_, offer)
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


async def checkpoints(request: web.Request) -> web.Response:
    """Every committed checkpoint still in the store, newest first, each with a presigned GET."""
    coord = request.app[COORDINATOR]
    node_of(request)
    views = [
        CheckpointView(info=info, url=coord.store.presign_get(info.key))
        for info in coord.checkpoints.listed()
    ]
    return ok(CheckpointList(checkpoints=views))


async def dataset(request: web.Request) -> web.Response:
    """The run's dataset id and a presigned GET of its manifest (``coordinator.store.datasets``)."""
    coord = request.app[COORDINATOR]
    node_of(request)
    book = coord.datasets
    await book.manifest()
    assert book.dataset is not None  # manifest() answered 404 otherwise
    return ok(
        DatasetView(
            dataset=book.dataset,
            manifest_url=coord.store.presign_get(book.key(MANIFEST_FILE)),
            manifest_size=book.manifest_size,
            expires_in_s=float(coord.config.server.presign_expiry_s),
        )
    )


async def dataset_files(request: web.Request) -> web.Response:
    """Presigned GETs for files the dataset's manifest lists, and only those."""
    coord = request.app[COORDINATOR]
    node_of(request)
    body = await read_body(request, DatasetFilesRequest)
    urls = await coord.datasets.urls(body.names)
    return ok(DatasetFiles(urls=urls, expires_in_s=float(coord.config.server.presign_expiry_s)))


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


async def metrics(request: web.Request) -> web.Response:
    coord = request.app[COORDINATOR]
    coord.metrics.set_members(m.state for m in coord.machine.db.members())
    coord.metrics.round.set(coord.machine.round_number())
    return web.Response(body=coord.metrics.render(), headers={"Content-Type": CONTENT_TYPE})


#: Headers of every dashboard file: never served stale, and nothing but this origin's own
#: script, style sheet and API may load or run on the page (no inline code, no framing).
DASHBOARD_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": (
        "default-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@functools.cache
def _dashboard_file(name: str) -> bytes:
    return resources.files("coordinator.api").joinpath("dashboard", name).read_bytes()


def _dashboard(endpoint: str, file: str) -> Handler:
    """The handler serving ``coordinator/api/dashboard/{file}`` as the route table types it."""
    media_type = ROUTES[endpoint].media_type

    async def serve(request: web.Request) -> web.Response:
        return web.Response(
            body=_dashboard_file(file),
            content_type=media_type,
            charset="utf-8",
            headers=DASHBOARD_HEADERS,
        )

    return serve


async def probe(request: web.Request) -> web.Response:
    """A throwaway object for ``sparseloco doctor``: one per node, replaced at each probe."""
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    req = await read_body(request, ProbeRequest)
    key = probe_key(coord.config.storage.prefix, coord.machine.run_id, node_id)
    await coord.store.delete_keys([key])  # write-once: the previous probe must go first
    granted = await grant(coord, key, req.size, req.sha256)
    log.info("event=probe_granted node=%s size=%d", node_id, req.size)
    return ok(
        ProbeGrant(
            key=key,
            put_url=granted.url,
            put_headers=granted.headers,
            get_url=coord.store.presign_get(key),
            expires_in_s=granted.expires_in_s,
        )
    )


HANDLERS: dict[str, Handler] = {
    "probe": probe,
    "dataset": dataset,
    "dataset_files": dataset_files,
    "join": join,
    "heartbeat": heartbeat,
    "leave": leave,
    "round": current_round,
    "upload": upload,
    "upload_complete": upload_complete,
    "submit": submit,
    "manifest": manifest,
    "report": report,
    "checkpoint_upload": checkpoint_upload,
    "checkpoint_complete": checkpoint_complete,
    "checkpoint_commit": checkpoint_commit,
    "checkpoint_latest": checkpoint_latest,
    "checkpoints": checkpoints,
    "status": status,
    "openapi": openapi,
    "metrics": metrics,
    "dashboard": _dashboard("dashboard", "index.html"),
    "dashboard_script": _dashboard("dashboard_script", "app.js"),
    "dashboard_style": _dashboard("dashboard_style", "style.css"),
}
