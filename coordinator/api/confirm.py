"""Confirming a round's submissions together before it closes (``coordinator.rules.payloadchecks``).

Submissions of payloads whose upload this process granted are answered without a HEAD. When
the round would close, the machine holds the close and asks for them (``confirm_wanted``);
``confirm_forever`` then lists the round's folder once, confirms every submission whose object
is there with the size it named, HEADs the others once more (a listing may lag a write on some
stores; a HEAD also sees a checksum where the store keeps one; a store that refuses the listing
gets a HEAD per submission) and hands the verdicts to
``RoundMachine.confirm``, which closes the round. One listing of up to 1,000 keys a page
replaces a HEAD per node and round. While the store does not answer, it tries again every
``RETRY_S``; the round stays open meanwhile (its deadline is paused while the store is down).
"""

from __future__ import annotations

import asyncio
import logging

from coordinator.api.service import Coordinator
from coordinator.base.errors import StorageError
from coordinator.store.object_store import ObjectInfo, retry_logged, sha256_b64
from protocol.keys import round_prefix

log = logging.getLogger("sparseloco.coordinator.app")

#: Seconds between tries while the store does not answer.
RETRY_S = 1.0


def matches(info: ObjectInfo | None, size: int, sha256: str) -> bool:
    """Whether a stored object has this size and (if the store keeps one) this checksum.

    An object uploaded in parts carries the digest of its parts' digests (``…-N``), not the
    whole's: only its size is checked here, its sha256 by every node that downloads it
    (``coordinator.store.multipart``)."""
    if info is None or info.size != size:
        return False
    stored = info.sha256_b64
    return stored is None or "-" in stored or stored == sha256_b64(sha256)


async def check_round(coord: Coordinator, round_: int, pending: dict[str, int]) -> set[str]:
    """The nodes of ``pending`` (node id -> size) whose object is not what they submitted."""
    storage = coord.config.storage
    run_id = coord.machine.run_id
    folder = round_prefix(storage.prefix, run_id, round_)
    try:
        listed = await coord.store.sizes(folder)
    except StorageError as exc:
        if exc.unreachable:
            raise  # tried again once the store answers
        # A refusal (a credential without the list permission) would refuse every try: each
        # object is looked at on its own instead, as before this check existed.
        log.warning("event=confirm_list_refused round=%d cause=%r fallback=head", round_, exc.code)
        listed = {}
    bad: set[str] = set()
    machine = coord.machine
    for node_id, size in sorted(pending.items()):
        # The submission's row is read only where needed: a key that names the digest, or an
        # object the listing did not show (at a thousand nodes, a thousand reads saved).
        row = machine.db.submission(round_, node_id) if machine.digest_keys else None
        if machine.digest_keys and row is None:
            bad.add(node_id)
            continue
        key = machine.payload_key(round_, node_id, None if row is None else row.sha256)
        if listed.get(key) == size:
            continue
        row = row or machine.db.submission(round_, node_id)
        if row is None or not matches(await coord.store.head(key), size, row.sha256):
            bad.add(node_id)
    return bad


async def confirm_forever(coord: Coordinator) -> None:
    """Confirm the submissions a close waits for, each time it waits for some, until
    cancelled."""
    while True:
        await coord.confirm_kick.wait()
        coord.confirm_kick.clear()
        while (wanted := coord.machine.confirm_wanted()) is not None:
            round_, pending = wanted
            try:
                bad = await check_round(coord, round_, pending)
                coord.after_close(coord.machine.confirm(round_, set(pending), bad))
            except Exception as exc:  # a round must not stay unclosable for one failure
                retry_logged(log, "confirm_retry", RETRY_S, exc)
                await asyncio.sleep(RETRY_S)
