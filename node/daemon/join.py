"""Joining the run: wait out another process holding the token, then settle whom to trust.

``join`` is the daemon's first call to the coordinator. A 409 ``token_in_use`` means another
process still holds this node's token: it is waited out for a bounded time (the other one may
be a predecessor that has just died), then refused. The join response names the manifest key;
``node.daemon.pinning`` checks it against the invite's fingerprint and the key pinned in the
state directory, and the response handed back carries the pinned key, the only one the daemon
verifies manifests with. A node that refuses the key leaves again before it says why, so an
open round does not wait for it.

``rejoin`` is the heartbeat's way back after the coordinator forgot the node (``not_member``);
its key is compared with the pinned one and a difference is logged, never adopted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from node.daemon.api import Clock, CoordinatorApi
from node.daemon.pinning import trusted_key
from node.daemon.retry import Backoff
from node.daemon.settings import NodeSettings
from node.errors import CoordinatorError, Refused
from protocol.errors import SparseLoCoError
from protocol.invite import key_fingerprint
from protocol.messages import JoinResponse

log = logging.getLogger("sparseloco.node")

CLIENT = "sparseloco-node/0.1"
#: Seconds a join waits for another process holding this node's token to go away.
TOKEN_IN_USE_WAIT_S = 120.0


async def join(api: CoordinatorApi, clock: Clock, settings: NodeSettings) -> JoinResponse:
    """The join response, its manifest key checked and pinned (``Refused`` if it is not the
    trusted one, or if another process keeps the token past ``TOKEN_IN_USE_WAIT_S``)."""
    joined = await _join_waiting(api, clock)
    try:
        key = trusted_key(
            settings.state_dir,
            joined.manifest_public_key,
            settings.manifest_key_fingerprint,
            node_id=joined.node_id,
        )
    except Refused:
        with contextlib.suppress(SparseLoCoError, aiohttp.ClientError, TimeoutError):
            await asyncio.wait_for(api.leave(), max(1.0, settings.stop_grace_s))
        raise
    return joined.model_copy(update={"manifest_public_key": key})


async def rejoin(api: CoordinatorApi, pinned: str) -> None:
    """Join again after the coordinator forgot this node; the pinned key stays the one used."""
    joined = await api.join(client=CLIENT)
    if joined.manifest_public_key.strip().lower() != pinned:
        log.error(
            "event=manifest_key_changed node=%s pinned=%s offered=%s (manifests are still"
            " verified with the pinned key; ask the run's operator)",
            joined.node_id,
            key_fingerprint(pinned),
            joined.manifest_public_key[:16],
        )


async def _join_waiting(api: CoordinatorApi, clock: Clock) -> JoinResponse:
    """Join the run; wait (bounded) while another process still holds this token."""
    waited_since: float | None = None
    backoff = Backoff(first_s=2.0, cap_s=10.0)
    while True:
        try:
            return await api.join(client=CLIENT)
        except CoordinatorError as exc:
            if exc.error != "token_in_use":
                raise
            now = clock.now()
            if waited_since is None:
                waited_since = now
                log.warning(
                    "event=token_in_use waiting_up_to_s=%.0f message=%r",
                    TOKEN_IN_USE_WAIT_S,
                    str(exc),
                )
            elif now - waited_since > TOKEN_IN_USE_WAIT_S:
                raise Refused(
                    f"another process is using this node's token (still after"
                    f" {TOKEN_IN_USE_WAIT_S:.0f} s): stop it, or give this node its own token"
                ) from exc
            await clock.sleep(backoff.next())
