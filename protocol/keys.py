"""The object-store key layout (DESIGN.md), in one place so node and coordinator agree on it.

Every key of a run lives under ``{prefix}/runs/{run_id}/``::

    rounds/{round:08d}/payloads/{node_id}.slc   a node's payload for a round (on a store that
                                                does not keep If-None-Match:
                                                ``{node_id}.{sha256}.slc``, write-once by naming)
    rounds/{round:08d}/manifest.json            the closed round, signed by the coordinator
    checkpoints/{round:08d}/model.safetensors   parameters at the start of a round
    checkpoints/{round:08d}/model.json          its sidecar: the committed CheckpointInfo
    checkpoints/latest.json                     which checkpoint is the newest
    probes/{node_id}.bin                        a node's throwaway object (``sparseloco doctor``)

Zero-padded rounds keep a plain listing in round order.
"""

from __future__ import annotations

import re

#: Node ids and run ids are short, printable and safe in a key and a URL path.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_ID = re.compile(ID_PATTERN)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def check_id(kind: str, value: str) -> str:
    """``value`` if it is a valid id, else ``ValueError`` naming ``kind``."""
    if not _ID.match(value):
        raise ValueError(f"invalid {kind} {value!r}: use 1-64 of A-Z a-z 0-9 _ . - ")
    return value


def run_prefix(prefix: str, run_id: str) -> str:
    """``{prefix}/runs/{run_id}/`` (no leading slash; an empty prefix is allowed)."""
    check_id("run id", run_id)
    head = prefix.strip("/")
    return f"{head}/runs/{run_id}/" if head else f"runs/{run_id}/"


def round_prefix(prefix: str, run_id: str, round_: int) -> str:
    if round_ < 0:
        raise ValueError(f"round must be >= 0, got {round_}")
    return f"{run_prefix(prefix, run_id)}rounds/{round_:08d}/"


def payload_key(
    prefix: str, run_id: str, round_: int, node_id: str, sha256: str | None = None
) -> str:
    """Key of ``node_id``'s payload for ``round_``; with ``sha256`` (hex), a key that names the
    payload's digest too, so another payload can never be written at it (write-once by naming,
    for a store that does not refuse a second write: ``coordinator.store.promises``)."""
    check_id("node id", node_id)
    if sha256 is None:
        return f"{round_prefix(prefix, run_id, round_)}payloads/{node_id}.slc"
    if not _SHA256.match(sha256):
        raise ValueError(f"invalid sha256 {sha256!r}: 64 lower-case hex digits")
    return f"{round_prefix(prefix, run_id, round_)}payloads/{node_id}.{sha256}.slc"


def manifest_key(prefix: str, run_id: str, round_: int) -> str:
    """Key of the signed manifest of closed round ``round_``."""
    return f"{round_prefix(prefix, run_id, round_)}manifest.json"


def checkpoint_key(prefix: str, run_id: str, round_: int) -> str:
    return f"{run_prefix(prefix, run_id)}checkpoints/{round_:08d}/model.safetensors"


def latest_checkpoint_key(prefix: str, run_id: str) -> str:
    return f"{run_prefix(prefix, run_id)}checkpoints/latest.json"


def sidecar_key(key: str) -> str:
    """The ``.json`` sidecar next to a checkpoint's ``.safetensors`` file."""
    return key.removesuffix(".safetensors") + ".json"


def probe_key(prefix: str, run_id: str, node_id: str) -> str:
    """Key of ``node_id``'s probe object: what ``sparseloco doctor`` uploads and reads back."""
    check_id("node id", node_id)
    return f"{run_prefix(prefix, run_id)}probes/{node_id}.bin"
