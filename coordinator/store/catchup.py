"""At start, learn the rounds the object store knows closed and this state directory does not.

A coordinator restored from a backup (``coordinator.state.backup``) is older than the one that died:
the rounds closed after the backup was taken are missing from its database, while the nodes
applied them. Reopening such a round would sign a second, different manifest for it with the
same key, and nodes that are past it stop (their state is ahead of the coordinator). But every
closed round's signed manifest is also in the store (``coordinator.store.publisher`` uploads it
right after the close), so before it serves, the coordinator reads the manifest of its newest round
not closed, checks its signature with its own key and its run and round, and adopts it: the
round is closed with that very manifest, the next one waits to open. It repeats until the
store has no manifest for the round, which is the normal case of a coordinator that merely
restarted (one GET that answers 404).

What cannot be learnt this way: a round whose manifest never reached the store (the store was
down when the old coordinator closed it, and it died before retrying); submissions, reports,
joins and token changes made after the backup. Nodes resubmit a payload the coordinator does
not know (``node.daemon.rounds``); the rest is in README's operator's guide (backups).
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from coordinator.base.config import CoordinatorConfig
from coordinator.base.errors import TRANSIENT, StartupError
from coordinator.state.db import Database
from coordinator.state.schema import DB_FILE
from coordinator.state.signing import KEY_FILE, ManifestSigner
from coordinator.store.object_store import ObjectStore
from protocol.errors import ManifestError
from protocol.keys import manifest_key
from protocol.messages import RoundState, SignedManifest
from protocol.signing import verify_manifest

log = logging.getLogger("sparseloco.coordinator.catchup")

#: Largest manifest read back (a gather set of many thousand entries is a few MB).
MAX_MANIFEST_BYTES = 64 * 1024 * 1024


async def learn_closed_rounds(config: CoordinatorConfig, store: ObjectStore) -> list[int]:
    """Close, from the store's signed manifests, the rounds the state directory has not
    closed; the rounds learnt (none for a new or an up-to-date state directory)."""
    state_dir = config.server.state_dir
    if not (state_dir / DB_FILE).is_file() or not (state_dir / KEY_FILE).is_file():
        return []
    public_key = ManifestSigner.load_or_create(state_dir).public_key_hex
    db = Database(state_dir / DB_FILE)
    try:
        if db.get_meta("run_id") != config.run_id:
            return []  # another run's state: create_app refuses it with the fix
        return await _learn(db, config, store, public_key)
    finally:
        db.close()


async def _learn(
    db: Database, config: CoordinatorConfig, store: ObjectStore, public_key: str
) -> list[int]:
    learnt: list[int] = []
    while True:
        cur = db.current_round()
        if cur is None or cur.state == RoundState.CLOSED:
            break
        key = manifest_key(config.storage.prefix, config.run_id, cur.round)
        try:
            body = await store.get_bytes(key, MAX_MANIFEST_BYTES)
        except TRANSIENT as exc:
            raise StartupError(
                f"cannot read {key} from the object store ({exc}); start again once it answers"
            ) from exc
        if body is None:
            break
        try:
            signed = SignedManifest.model_validate_json(body)
            manifest = verify_manifest(signed, public_key, run_id=config.run_id, round_=cur.round)
        except (ValidationError, ManifestError) as exc:
            raise StartupError(
                f"the store holds a manifest of round {cur.round} ({key}) that this state"
                f" directory did not sign or cannot read ({exc}); it is not this run's"
                " coordinator state, or the store's prefix is shared: fix --state-dir or"
                " [storage] prefix"
            ) from exc
        with db.tx():
            db.adopt_round(
                cur.round,
                manifest.opened_at,
                manifest.closed_at,
                manifest.base_fingerprint,
                signed.model_dump_json(),
            )
            if cur.round + 1 < config.run.rounds:
                db.insert_round(cur.round + 1, RoundState.WAITING, None, None)
        learnt.append(cur.round)
    if learnt:
        log.warning(
            "event=rounds_learnt_from_store first=%d last=%d why=%s",
            learnt[0],
            learnt[-1],
            "the state directory was behind the run (restored from a backup?); these rounds"
            " are closed with the manifests their nodes applied",
        )
    return learnt
