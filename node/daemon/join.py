"""Joining the run: refuse at once a token another process holds, then settle whom to trust.

``join`` is the daemon's first call to the coordinator. A 409 ``token_in_use`` means another
live process holds this node's token, on another state directory or another host (a restart on
the same state directory names its predecessor and takes over at once: ``node.daemon.instance``).
That is a mistake the user should hear about now, not after a wait: ``Refused`` at once, with
what to do (the node exits with status 2). The join response names the manifest key;
``node.daemon.pinning`` checks it against the invite's fingerprint and the key pinned in the
state directory, and the response handed back carries the pinned key, the only one the daemon
verifies manifests with. A node that refuses the key leaves again before it says why, so an
open round does not wait for it.

``rejoin`` is the heartbeat's way back after the coordinator forgot the node (``not_member``);
its key is compared with the pinned one and a difference is logged, never adopted.

``refusal`` words the other ways the coordinator stops accepting a running node's token: the
operator revoked it (401 ``token_revoked``, learnt at the latest by the next heartbeat), it was
never valid, or another process took this one's place (a restart on the same state directory,
or one that joined while this one was silent past the heartbeat timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from node.daemon.api import CoordinatorApi
from node.daemon.pinning import trusted_key
from node.daemon.settings import NodeSettings
from node.errors import CoordinatorError, Refused
from protocol.errors import SparseLoCoError
from protocol.invite import key_fingerprint
from protocol.messages import JoinResponse

log = logging.getLogger("sparseloco.node")

CLIENT = "sparseloco-node/0.1"


async def join(api: CoordinatorApi, settings: NodeSettings) -> JoinResponse:
    """The join response, its manifest key checked and pinned (``Refused`` if it is not the
    trusted one, or if another process holds this node's token)."""
    try:
        joined = await api.join(client=CLIENT)
    except CoordinatorError as exc:
        if exc.error == "token_in_use":
            raise Refused(token_in_use_message(exc)) from exc
        raise
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


def refusal(exc: CoordinatorError) -> Refused:
    """``Refused`` for a token the coordinator stopped accepting from this running process (a
    401, or 409 ``token_in_use`` after the join), saying why and what to do."""
    if exc.error == "token_revoked":
        why = (
            "the run's operator revoked this node's token (401 token_revoked): it takes no"
            " further part in this run; ask the operator for a new token"
        )
    elif exc.error == "token_in_use":
        why = (
            f"{exc}: another process now holds this node's place (one started with the same"
            " token on this --state-dir, or after this one fell silent); this one stops, so"
            " that the two do not both take part as this node"
        )
    else:
        why = (
            f"the coordinator refused this node's token ({exc.status} {exc.error}): it was"
            " never issued for this run, or was replaced; ask the run's operator for a valid one"
        )
    return Refused(why)


def token_in_use_message(exc: CoordinatorError) -> str:
    """What a node refused with 409 ``token_in_use`` at its join tells its user (the
    coordinator's part says how long until a silent holder counts as gone)."""
    return (
        f"{exc}. One token serves one node process: stop the other process (on another"
        " --state-dir or host) or get a token of this node's own from the run's operator; a"
        " restart on the same --state-dir takes over at once"
    )
