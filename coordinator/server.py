"""Running the coordinator as a process: listen, announce the URL, stop cleanly on a signal.

``serve`` runs on one uvloop event loop. Before anything is written it binds the port and checks
the object store (``coordinator.preflight``: a ``StartupError`` names what to fix); only then
does it open the state directory. Once the socket listens it writes
``{state_dir}/coordinator.json`` (``url``, ``pid``, ``run_id``) atomically, so tests and
``sparseloco up`` can find a port chosen with ``--port 0``. SIGTERM or SIGINT stops it in a fixed
order: stop accepting, release long-polls, let in-flight requests finish, cancel the ticker, then
the publisher, close the database, remove ``coordinator.json``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path

from aiohttp import web

from coordinator.app import create_app, s3_store
from coordinator.config import CoordinatorConfig
from coordinator.preflight import check_store, listen_socket
from coordinator.service import COORDINATOR

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


async def serve(config: CoordinatorConfig) -> None:
    """Check the port and the store, then run the service until SIGTERM or SIGINT."""
    sock = listen_socket(config.server.host, config.server.port)
    try:
        store = s3_store(config)
        await check_store(
            store,
            endpoint=config.storage.endpoint_url,
            prefix=config.storage.prefix,
            run_id=config.run_id,
        )
        app = create_app(config, store=store)
    except BaseException:
        sock.close()
        raise
    run_id = app[COORDINATOR].machine.run_id
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    announce: Path | None = None
    try:
        site = web.SockSite(runner, sock)
        await site.start()
        host, port = runner.addresses[0][:2]
        url = f"http://{host}:{port}"
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
