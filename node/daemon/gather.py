"""A closed round's gather set, from the node's side: verify, fetch, validate.

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

from node.compute.worker import Worker, check_payload_header
from node.daemon.transfer import TransferTimeouts, get_object
from node.errors import DigestError
from protocol.codec import Payload
from protocol.errors import ManifestError, PayloadError
from protocol.messages import Manifest, ManifestView


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
