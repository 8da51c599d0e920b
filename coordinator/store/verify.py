"""Verifying an uploaded checkpoint before it is committed.

A node's word that a file holds θ_R is not enough: a joiner that loads a wrong checkpoint rejects
it and falls back to θ_0, and if retention already pruned the payloads since θ_0 on the strength
of that checkpoint, the joiner is stranded. So before a commit is recorded the coordinator reads
the stored object back and checks it:

- its size and sha256 are the offer's (the store's own checksum is not relied on: not every
  store keeps one);
- it is a well-formed safetensors file of F32 tensors whose fingerprint
  (``protocol.fingerprint.SafetensorsDigest``, pure Python: the coordinator has no torch) is the
  offered one; the caller has checked that the offered one is the majority the round's
  participants reported, before the download and again after it.

The object is streamed (``ObjectStore.read_chunks``, on a thread off the event loop): each chunk
of ``VERIFY_CHUNK`` bytes goes through sha256 and the streaming safetensors reader as it
arrives, then is dropped. Cost, per commit: one download of the file and one pass over it for
sha256 and one for the fingerprint. Memory: one chunk and the file's header (at most
``protocol.fingerprint.MAX_HEADER_BYTES``), whatever the checkpoint's size, so
``storage.max_checkpoint_bytes`` bounds only the download and the time it takes (a larger object
is refused after ``size + 1`` bytes). Verifications still run one at a time: each holds a thread
of the executor for its whole download.
"""

from __future__ import annotations

import asyncio
import hashlib

from coordinator.base.errors import BadCheckpoint, Conflict, TooLarge
from coordinator.store.object_store import ObjectStore
from protocol.errors import PayloadError
from protocol.fingerprint import CheckedFile, SafetensorsDigest
from protocol.messages import CheckpointUpload

#: Bytes of the checkpoint held at once while it is verified.
VERIFY_CHUNK = 1 << 20


class FileCheck:
    """Consumes a file chunk by chunk (``update``) and says what is wrong with it as the file an
    offer describes (``problem``). The safetensors reader stops at the first malformed byte;
    size and sha256 go on, so a file that is not the offered one is reported as such first."""

    def __init__(self) -> None:
        self.size = 0
        self._sha = hashlib.sha256()
        self._reader = SafetensorsDigest(sha256=False)
        self._malformed: PayloadError | None = None

    def update(self, chunk: bytes) -> None:
        self.size += len(chunk)
        self._sha.update(chunk)
        if self._malformed is None:
            try:
                self._reader.update(chunk)
            except PayloadError as exc:
                self._malformed = exc

    def problem(self, offer: CheckpointUpload) -> str | None:
        """What is wrong with the file seen, as the file ``offer`` describes; ``None`` if
        nothing."""
        if self.size != offer.size:
            return f"the file holds {self.size} bytes, not the offered {offer.size}"
        if self._sha.hexdigest() != offer.sha256:
            return "the file's sha256 is not the offered one"
        try:
            if self._malformed is not None:
                raise self._malformed
            checked: CheckedFile = self._reader.finish()
        except PayloadError as exc:
            return f"the file is not a checkpoint of F32 tensors ({exc})"
        if checked.fingerprint != offer.fingerprint:
            return (
                f"the file's tensors have fingerprint {checked.fingerprint}, not the offered"
                f" {offer.fingerprint}"
            )
        return None


def check_file(data: bytes, offer: CheckpointUpload) -> str | None:
    """What is wrong with ``data`` as the file ``offer`` describes; ``None`` if nothing."""
    check = FileCheck()
    check.update(data)
    return check.problem(offer)


class CheckpointVerifier:
    """Streams uploaded checkpoint files back from ``store`` and checks them, one at a time."""

    def __init__(self, store: ObjectStore, *, chunk_bytes: int = VERIFY_CHUNK) -> None:
        self.store = store
        self.chunk_bytes = chunk_bytes
        self._one_at_a_time = asyncio.Lock()

    async def verify(self, key: str, offer: CheckpointUpload) -> None:
        """Return if the object at ``key`` is exactly the offered file; ``missing`` (409) if
        there is none, ``BadCheckpoint`` (409) if it is anything else."""
        async with self._one_at_a_time:
            check = FileCheck()
            try:
                found = await self.store.read_chunks(
                    key, offer.size, check.update, chunk_bytes=self.chunk_bytes
                )
            except TooLarge:
                raise BadCheckpoint(
                    f"the file is larger than the offered {offer.size} bytes"
                ) from None
            if not found:
                raise Conflict("missing", f"nothing was uploaded at {key}")
            problem = check.problem(offer)
        if problem is not None:
            raise BadCheckpoint(problem)
