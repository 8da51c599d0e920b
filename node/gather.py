"""A closed round's gather set, from the node's side: verify, fetch, validate.

- ``verify_manifest``: the coordinator's Ed25519 signature over the manifest's canonical bytes,
  and that it is for this run and round.
- ``fetch_gather``: every gathered payload through its presigned GET, in parallel, sizes and
  sha256 checked; the node's own payload is taken from memory when the digest matches.
- ``decode_gather``: each payload validated against the run's model and codec, and its header
  against the manifest (run, round, node).

What is left out is left out by *every* honest node alike: a payload whose stored bytes do not
match the manifest (all nodes read the same bytes) or that fails validation. A transfer that
fails only here raises instead, so this node never applies an aggregate its peers did not.
"""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from node.transfer import DigestError, TransferTimeouts, get_object
from node.worker import Worker, check_payload_header
from protocol.codec import Payload
from protocol.errors import PayloadError, SparseLoCoError
from protocol.messages import Manifest, ManifestView, manifest_bytes


class ManifestError(SparseLoCoError, ValueError):
    """A manifest failed verification (bad signature, other run or round)."""


def verify_manifest(
    public_key: Ed25519PublicKey, view: ManifestView, *, run_id: str, round_: int
) -> Manifest:
    """The manifest, once its signature and its run and round check out."""
    manifest = view.signed.manifest
    try:
        public_key.verify(bytes.fromhex(view.signed.signature), manifest_bytes(manifest))
    except (InvalidSignature, ValueError) as exc:
        raise ManifestError(f"round {round_}: manifest signature does not verify") from exc
    if manifest.run_id != run_id or manifest.round != round_:
        raise ManifestError(
            f"manifest is for run {manifest.run_id} round {manifest.round},"
            f" expected {run_id} round {round_}"
        )
    return manifest


async def fetch_gather(
    http: aiohttp.ClientSession,
    view: ManifestView,
    manifest: Manifest,
    *,
    own: bytes | None,
    own_id: str,
    parallel: int,
    timeouts: TransferTimeouts,
) -> tuple[dict[str, bytes], dict[str, str]]:
    """Payload bytes by node id, and the nodes left out with the reason (bad digest only)."""
    gate = asyncio.Semaphore(parallel)
    blobs: dict[str, bytes] = {}
    rejected: dict[str, str] = {}

    async def fetch(node: str, size: int, sha: str) -> None:
        if node == own_id and own and hashlib.sha256(own).hexdigest() == sha:
            blobs[node] = own
            return
        if node not in view.urls:
            raise ManifestError(f"round {manifest.round}: no download URL for {node}")
        async with gate:
            try:
                blobs[node] = await get_object(
                    http, view.urls[node], size=size, sha256=sha, timeouts=timeouts
                )
            except DigestError as exc:
                rejected[node] = f"bad digest: {exc}"

    await asyncio.gather(*(fetch(e.node_id, e.size, e.sha256) for e in manifest.gather))
    return blobs, rejected


def decode_gather(
    worker: Worker, blobs: dict[str, bytes], round_: int
) -> tuple[dict[str, Payload], dict[str, str]]:
    """Validated payloads by node id, and the ones that failed validation with the reason."""
    payloads: dict[str, Payload] = {}
    rejected: dict[str, str] = {}
    for node in sorted(blobs):
        try:
            payload = worker.read(blobs[node])
            check_payload_header(payload, run_id=worker.run_id, round_=round_, node_id=node)
            payloads[node] = payload
        except PayloadError as exc:
            rejected[node] = f"failed validation: {exc}"
    return payloads, rejected
