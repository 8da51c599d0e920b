"""The coordinator's aiohttp app: its parts wired together, and its background tasks.

``create_app`` opens the state directory (database, signing key), seeds the node tokens from
the config (``coordinator.rules.tokens``: only for nodes the database holds no token for), builds
the ``Coordinator`` (``coordinator.api.service``) with its metrics started from the database's
totals, and registers one handler per entry of ``protocol.routes.ENDPOINTS``, by name, from
``coordinator.api.handlers.HANDLERS``. The rate limits of ``[limits]`` live under ``LIMITS``; the
connection limits are the server's (``coordinator.base.limits.server_settings``).

Background tasks (the store probe, ``coordinator.store.storewatch``; the ticker that applies token
revocations, times out members and closes overdue rounds, the publisher of manifests and
checkpoint sidecars, and retention) are owned by the app's cleanup context and cancelled in that
order on shutdown, after the long-polls were released; the database closes last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from coordinator.api.confirm import confirm_forever
from coordinator.api.handlers import HANDLERS
from coordinator.api.handling import (
    TOKENS,
    add_heard,
    durable_answers,
    error_middleware,
    known_query,
)
from coordinator.api.service import COORDINATOR, Coordinator
from coordinator.base.config import CoordinatorConfig
from coordinator.base.limits import LIMITS, Limits
from coordinator.monitoring.metrics import CoordinatorMetrics, totals
from coordinator.rules.checkpoints import CheckpointBook
from coordinator.rules.machine import RoundMachine
from coordinator.rules.tokens import TokenBook, TokenTable
from coordinator.state.db import Database
from coordinator.state.durability import GroupSync
from coordinator.state.schema import DB_FILE
from coordinator.state.signing import ManifestSigner
from coordinator.store.datasets import DatasetBook
from coordinator.store.multipart import PartStore, S3Parts
from coordinator.store.object_store import ObjectStore
from coordinator.store.publisher import ManifestPublisher
from coordinator.store.retention import Retention
from coordinator.store.storage import S3Store
from coordinator.store.storewatch import StoreWatch, WatchedStore
from coordinator.store.verify import CheckpointVerifier
from protocol.keys import run_prefix
from protocol.messages import MemberState
from protocol.routes import ENDPOINTS, ROUND

log = logging.getLogger("sparseloco.coordinator.app")

#: Seconds between ticks (member timeouts, waiting rounds opening, deadlines).
TICK_S = 0.25
#: The loop watch: a timer every LAG_PROBE_S; a window's worst delay is logged past LAG_LOG_S.
LAG_PROBE_S = 0.05
LAG_WINDOW_S = 10.0
LAG_LOG_S = 0.05
#: How a round number in a path is matched: digits only, so a bad one is a plain 404.
ROUND_PATTERN = r"{round:\d{1,18}}"


async def _ticker(coord: Coordinator) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        try:
            coord.apply_token_changes()
            coord.after_close(coord.machine.tick())
            coord.wake_opened()
        except Exception:  # one bad tick must not stop timeouts and deadlines for good
            log.exception("event=tick_failed")


async def _loop_watch() -> None:
    """Log how late the event loop ran a timer when it was late by more than ``LAG_LOG_S``
    (at most once per ``LAG_WINDOW_S``): work that holds the loop delays every answer."""
    worst, since = 0.0, time.monotonic()
    while True:
        start = time.monotonic()
        await asyncio.sleep(LAG_PROBE_S)
        now = time.monotonic()
        worst = max(worst, now - start - LAG_PROBE_S)
        if now - since >= LAG_WINDOW_S:
            if worst >= LAG_LOG_S:
                log.warning("event=loop_lag max_ms=%.0f window_s=%.0f", 1000 * worst, now - since)
            worst, since = 0.0, now


async def _background(app: web.Application) -> AsyncIterator[None]:
    coord = app[COORDINATOR]
    watch = asyncio.create_task(_loop_watch(), name="loop_watch")
    ticker = asyncio.create_task(_ticker(coord), name="ticker")
    publisher = asyncio.create_task(coord.publisher.run(), name="publisher")
    retention = asyncio.create_task(coord.retention.run_forever(), name="retention")
    confirmer = asyncio.create_task(confirm_forever(coord), name="confirmer")
    tasks = [ticker, publisher, retention, watch, confirmer]
    if coord.storewatch is not None:
        folder = run_prefix(coord.config.storage.prefix, coord.machine.run_id)
        probe = coord.storewatch.probe_forever(coord.store, folder)
        tasks.insert(0, asyncio.create_task(probe, name="store_probe"))
    yield
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    close = getattr(coord.store, "close", None)  # an S3Store's HTTP session
    if close is not None:
        await close()
    try:
        coord.tokens.flush_used(force=True)
    finally:
        if coord.sync is not None:
            coord.sync.close()
        coord.machine.db.close()
    log.info("event=background_stopped")


async def _release_waiters(app: web.Application) -> None:
    app[COORDINATOR].release_waiters()


def s3_store(config: CoordinatorConfig) -> S3Store:
    """The boto3 store of ``config.storage`` (``create_app``'s default)."""
    storage = config.storage
    return S3Store(
        endpoint_url=storage.endpoint_url,
        bucket=storage.bucket,
        access_key=storage.access_key,
        secret_key=storage.secret_key,
        region=storage.region,
        expiry_s=config.server.presign_expiry_s,
    )


def multipart_of(store: ObjectStore) -> PartStore | None:
    """Multipart uploads on ``store``, if it is the S3 store (a test's fake store has none) and
    its multipart uploads work (``coordinator.store.promises``)."""
    if not isinstance(store, S3Store) or not store.profile.multipart:
        return None
    return S3Parts(
        store.client,
        store.bucket,
        store.run,
        store.presign_part,
        conditional=lambda: store.profile.complete_header,
        checksums=lambda: store.profile.checksum_header,
    )


def _tokens(
    db: Database, config: CoordinatorConfig, machine: RoundMachine, clock: Callable[[], float]
) -> TokenBook:
    """Seed the config's tokens, then take out members revoked while the coordinator was down."""
    TokenTable(db).seed(config.tokens, clock())
    book = TokenBook(db, clock=clock)
    machine.revoke(book.revoked_nodes())
    if not book.active_nodes():
        log.warning(
            "event=no_tokens fix=%s",
            "no node can join: add one with `sparseloco coordinator token add NODE_ID"
            " --config run.toml` (as the README does), or list nodes under [tokens] in the config",
        )
    return book


def create_app(
    config: CoordinatorConfig,
    *,
    store: ObjectStore | None = None,
    clock: Callable[[], float] = time.time,
    group_commit: bool = True,
) -> web.Application:
    """Open (or create) the state in ``config.server.state_dir`` and build the app.

    ``store`` defaults to the S3 store of ``config.storage``. Raises ``ConfigError`` if the state
    directory belongs to another run. With ``group_commit`` (the default) commits are synced
    in groups off the event loop and every answer waits for its state to be on disk
    (``coordinator.state.durability``); without it every commit syncs itself.
    """
    state_dir = config.server.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    storage = config.storage
    if store is None:
        store = s3_store(config)
    db = Database(state_dir / DB_FILE, durable=not group_commit)
    signer = ManifestSigner.load_or_create(state_dir)
    try:
        # Write-once by naming where the store does not refuse a second write (what the
        # start-up's store check found: ``coordinator.store.promises``).
        digest_keys = isinstance(store, S3Store) and store.profile.digest_keys
        machine = RoundMachine(
            db, config.run, signer, prefix=storage.prefix, clock=clock, digest_keys=digest_keys
        )
        tokens = _tokens(db, config, machine, clock)
    except BaseException:
        db.close()
        raise
    storewatch = StoreWatch(machine)
    parts = multipart_of(store)
    store = WatchedStore(store, storewatch)
    metrics = CoordinatorMetrics(
        totals(db), inner_steps=config.run.inner_steps, topk=config.run.topk
    )
    metrics.nodes.from_reports(db)
    metrics.nodes.forget(m.node_id for m in db.members() if m.state == MemberState.REVOKED)
    coord = Coordinator(
        config=config,
        machine=machine,
        checkpoints=CheckpointBook(
            db,
            config.run,
            current_round=machine.round_number,
            prefix=storage.prefix,
            grant_s=config.server.presign_expiry_s,
            max_bytes=storage.max_checkpoint_bytes,
            clock=clock,
            votes=machine.votes,
        ),
        store=store,
        signer=signer,
        metrics=metrics,
        publisher=ManifestPublisher(
            db, store, prefix=storage.prefix, run_id=machine.run_id, metrics=metrics
        ),
        retention=Retention(
            db,
            store,
            config.run,
            prefix=storage.prefix,
            current_round=machine.round_number,
            metrics=metrics,
            parts=parts,
            # A grant's URLs die after presign_expiry_s; an upload twice that old is abandoned.
            stale_upload_s=2.0 * config.server.presign_expiry_s,
        ),
        tokens=tokens,
        verifier=CheckpointVerifier(store),
        datasets=DatasetBook(store, config.run.dataset, prefix=storage.prefix),
        sync=GroupSync(db) if group_commit else None,
        storewatch=storewatch,
        parts=parts,
    )
    app = web.Application(
        middlewares=[durable_answers, error_middleware],
        client_max_size=config.server.max_body_bytes,
    )
    app[COORDINATOR] = coord
    app[TOKENS] = coord.tokens
    app[LIMITS] = Limits(config.limits)
    for ep in ENDPOINTS:
        handler = HANDLERS[ep.name]
        if ep.path.startswith("/v1/"):  # the API; not the page, its files or the metrics
            handler = known_query(ep, handler)
        app.router.add_route(
            ep.method, ep.path.replace(ROUND, ROUND_PATTERN), handler, name=ep.name
        )
    app.on_response_prepare.append(add_heard)
    app.on_shutdown.append(_release_waiters)
    app.cleanup_ctx.append(_background)
    return app
