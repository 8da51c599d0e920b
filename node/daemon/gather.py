"""A closed round's gather set, from the node's side: fetch and validate.

- ``fetch_gather``: every gathered payload through its presigned GET, in parallel, sizes and
  sha256 checked, the node's own included: it must aggregate exactly the bytes its peers read.
- ``decode_gather``: each payload validated against the run's model and codec, and its header
  against the manifest (run, round, node).

The manifest's signature is checked before either runs (``protocol.signing.verify_manifest``).
What is left out is left out by *every* honest node alike: a payload whose stored bytes do not
match the manifest (all nodes read the same bytes) or that fails validation. A transfer that
fails only here raises instead, so this node never applies an aggregate its peers did not; the
downloads run in one ``asyncio.TaskGroup``, so the first failure cancels its siblings and the
caller can start over with fresh URLs at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from node.compute.worker import Worker, check_payload_header
from node.daemon.api import Transfers
from node.errors import DigestError
from protocol.codec import Payload
from protocol.errors import ManifestError, PayloadError
from protocol.messages import Manifest, ManifestView


async def fetch_gather(
    transfers: Transfers,
    view: ManifestView,
    manifest: Manifest,
    *,
    parallel: int,
) -> tuple[dict[str, bytes], dict[str, str]]:
    """Payload bytes by node id, and the nodes left out with the reason (bad digest only).

    Raises the first transfer failure (after the transfer's own retries), every other download
    cancelled; ``ManifestError`` if a gathered node has no URL.
    """
    gate = asyncio.Semaphore(parallel)
    blobs: dict[str, bytes] = {}
    rejected: dict[str, str] = {}

    async def fetch(node: str, size: int, sha: str) -> None:
        # The node's own payload is fetched from the store like every other: if someone with
        # store credentials swapped it after the submit, the peers reject it as a bad digest,
        # and so must its owner, or it would aggregate other bytes than they do.
        if node not in view.urls:
            raise ManifestError(f"round {manifest.round}: no download URL for {node}")
        async with gate:
            try:
                blobs[node] = await transfers.get(view.urls[node], size=size, sha256=sha)
            except DigestError as exc:
                rejected[node] = f"bad digest: {exc}"

    try:
        async with asyncio.TaskGroup() as group:
            for entry in manifest.gather:
                group.create_task(fetch(entry.node_id, entry.size, entry.sha256))
    except BaseExceptionGroup as failed:
        # One failure is the answer (the others were cancelled because of it).
        raise failed.exceptions[0] from None
    return blobs, rejected


def decode_gather(
    worker: Worker, blobs: Mapping[str, bytes], round_: int
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
