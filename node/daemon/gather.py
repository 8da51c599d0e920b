"""A closed round's gather set, from the node's side: fetch every payload, verified.

``fetch_gather`` downloads every gathered payload through its presigned GET, in parallel, sizes
and sha256 checked, the node's own included: it must aggregate exactly the bytes its peers read.
A node of one process keeps them in memory; a node of several (``spool``) streams each to a
file in its state dir, which every rank then reads its own tensors' records of
(``node.daemon.ops.read_gather``): the node downloads each payload once, through one link,
and no process holds all of them. The validation against the run's model and the manifest
happens there, on every rank.

The manifest's signature is checked before either runs (``protocol.signing.verify_manifest``).
What is left out is left out by *every* honest node alike: a payload whose stored bytes do not
match the manifest (all nodes read the same bytes) or that fails validation. A transfer that
fails only here raises instead, so this node never applies an aggregate its peers did not; the
downloads run in one ``asyncio.TaskGroup``, so the first failure cancels its siblings and the
caller can start over with fresh URLs at once.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path

from node.daemon.api import Transfers
from node.errors import DigestError
from protocol.errors import ManifestError
from protocol.messages import Manifest, ManifestView

#: A gathered payload: its bytes, or the path of the file it was downloaded to.
Blobs = dict[str, bytes | str]


@dataclass(frozen=True)
class Spool:
    """Where a node of ``world`` processes downloads each round's payloads: a folder per round
    under ``state_dir/spool``; a node of one process has none (it keeps them in memory)."""

    state_dir: Path
    world: int

    def folder(self, round_: int) -> Path | None:
        """Round ``round_``'s folder (None: one process keeps the payloads in memory)."""
        if self.world == 1:
            return None
        return self.state_dir / "spool" / f"{round_:08d}"

    def drop(self, round_: int | None = None) -> None:
        """Delete round ``round_``'s downloaded payloads (every round's when None)."""
        if self.world == 1:
            return
        spool = self.state_dir / "spool"
        shutil.rmtree(spool if round_ is None else spool / f"{round_:08d}", ignore_errors=True)


async def fetch_gather(
    transfers: Transfers,
    view: ManifestView,
    manifest: Manifest,
    *,
    parallel: int,
    spool: Path | None = None,
) -> tuple[Blobs, dict[str, str]]:
    """Payloads by node id (bytes; with ``spool``, files there), and the nodes left out with
    the reason (bad digest only).

    Raises the first transfer failure (after the transfer's own retries), every other download
    cancelled; ``ManifestError`` if a gathered node has no URL.
    """
    gate = asyncio.Semaphore(parallel)
    blobs: Blobs = {}
    if spool is not None:
        spool.mkdir(parents=True, exist_ok=True)
    rejected: dict[str, str] = {}

    async def fetch(node: str, size: int, sha: str) -> None:
        # The node's own payload is fetched from the store like every other: if someone with
        # store credentials swapped it after the submit, the peers reject it as a bad digest,
        # and so must its owner, or it would aggregate other bytes than they do.
        if node not in view.urls:
            raise ManifestError(f"round {manifest.round}: no download URL for {node}")
        async with gate:
            try:
                if spool is None:
                    blobs[node] = await transfers.get(view.urls[node], size=size, sha256=sha)
                else:
                    path = spool / f"{node}.slc"
                    await transfers.get_to_file(view.urls[node], path, size=size, sha256=sha)
                    blobs[node] = str(path)
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
