"""Running the coordinator as a process: listen, announce the URL, stop cleanly on a signal.

``serve`` runs on one uvloop event loop. Before anything is written it binds the port and checks
the object store (``coordinator.ops.preflight``: a ``StartupError`` names what to fix); only then
does it open the state directory, first closing the rounds the store knows closed and the state
directory does not (``coordinator.store.catchup``: a state restored from a backup). Once the socket
listens it writes ``{state_dir}/coordinator.json`` (``url``, ``pid``, ``run_id``) atomically, so
tests and ``sparseloco up`` can find a port chosen with ``--port 0``. SIGTERM or SIGINT stops it
in a fixed order: stop accepting, release long-polls, let in-flight requests finish, cancel the
ticker, then the publisher, close the database, remove ``coordinator.json``. Every connection is
held to the ``[limits]`` of ``coordinator.base.limits`` (request head and idle timeout, header
sizes).

With ``[server] tls_cert`` and ``tls_key`` set it serves HTTPS itself (``tls_context``; the
certificate is loaded before the port is bound, so a bad file stops it with exit 2), and the
announced URL is ``https://``. Without them it speaks plain HTTP, for loopback or behind a TLS
proxy (deploy/README.md).

Once the app is built, everything start-up left alive is frozen out of the garbage collector's
sight (``freeze_startup_objects``), so a full collection no longer stops the loop for a tenth of
a second.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import ssl
from pathlib import Path

from aiohttp import web

from coordinator.api.app import create_app, s3_store
from coordinator.api.service import COORDINATOR
from coordinator.base.config import CoordinatorConfig, ServerConfig
from coordinator.base.limits import server_settings
from coordinator.ops.preflight import adopt_promises, check_store, listen_socket
from coordinator.store.catchup import learn_closed_rounds
from coordinator.store.datasets import check_dataset
from protocol.errors import ConfigError

log = logging.getLogger("sparseloco.coordinator.server")

ANNOUNCE_FILE = "coordinator.json"
#: Seconds in-flight requests get to finish after a stop signal.
SHUTDOWN_GRACE_S = 10.0


def write_announce(state_dir: Path, url: str, run_id: str) -> Path:
    """Write ``coordinator.json`` atomically (write a temporary file, then rename)."""
    path = state_dir / ANNOUNCE_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"url": url, "pid": os.getpid(), "run_id": run_id}))
    os.replace(tmp, path)
    return path


def tls_context(server: ServerConfig) -> ssl.SSLContext | None:
    """The server side of TLS from ``tls_cert`` and ``tls_key``; None when they are not set."""
    if server.tls_cert is None or server.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(server.tls_cert, server.tls_key)
    except (OSError, ssl.SSLError) as exc:
        # No key material in the message: only the paths and the library's reason.
        raise ConfigError(
            f"config field server.tls_cert/tls_key: cannot load {server.tls_cert} with"
            f" {server.tls_key} ({getattr(exc, 'strerror', None) or exc}); give a PEM"
            " certificate chain and its matching private key"
        ) from None
    return context


def freeze_startup_objects() -> int:
    """Move every object alive after start-up to the collector's permanent generation
    (``gc.freeze``); how many there are.

    Start-up leaves about 10⁵ objects that live as long as the process (botocore's service model,
    the modules, pydantic's validators). Every full collection walked them all, with the event
    loop stopped: 70-150 ms on a busy 2-core machine, a few times a round at a thousand nodes,
    and every request that arrived meanwhile (heartbeats first) waited that long. Frozen, a full
    collection walks only what the run made since (5-20 ms). Only the cycle collector skips
    them: one dropped later is still freed by its reference count (unless it is in a cycle).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve(config: CoordinatorConfig) -> None:
    """Check the port and the store, then run the service until SIGTERM or SIGINT."""
    tls = tls_context(config.server)
    sock = listen_socket(config.server.host, config.server.port)
    try:
        store = s3_store(config)
        await check_store(
            store,
            endpoint=config.storage.endpoint_url,
            prefix=config.storage.prefix,
            run_id=config.run_id,
        )
        await adopt_promises(store, config.storage, run_id=config.run_id)
        await learn_closed_rounds(config, store)  # a state dir restored from a backup
        app = create_app(config, store=store)
        await check_dataset(app[COORDINATOR].datasets)
    except BaseException:
        sock.close()
        raise
    run_id = app[COORDINATOR].machine.run_id
    log.info("event=gc_frozen objects=%d", freeze_startup_objects())
    runner = web.AppRunner(
        app,
        access_log=None,
        shutdown_timeout=SHUTDOWN_GRACE_S,
        **server_settings(config.limits),
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    announce: Path | None = None
    try:
        site = web.SockSite(runner, sock, ssl_context=tls)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"{'https' if tls else 'http'}://{host}:{port}"
        announce = write_announce(config.server.state_dir, url, run_id)
        log.info("event=listening url=%s run=%s pid=%d", url, run_id, os.getpid())
        await stop.wait()
        log.info("event=stopping run=%s", run_id)
    finally:
        await runner.cleanup()
        sock.close()  # the server closed it already once it served; not if it never did
        if announce is not None:
            announce.unlink(missing_ok=True)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    log.info("event=stopped run=%s", run_id)
