"""Verifying an uploaded checkpoint before it is committed.

A node's word that a file holds θ_R is not enough: a joiner that loads a wrong checkpoint rejects
it and falls back to θ_0, and if retention already pruned the payloads since θ_0 on the strength
of that checkpoint, the joiner is stranded. So before a commit is recorded the coordinator reads
the stored object back and checks, off the event loop:

- its size and sha256 are the offer's (the store's own checksum is not relied on: not every
  store keeps one);
- it is a well-formed safetensors file of F32 tensors whose fingerprint
  (``protocol.fingerprint.fingerprint_safetensors``, pure Python: the coordinator has no torch)
  is the offered one; the caller has checked that the offered one is the majority the round's
  participants reported, before the download and again after it.

Cost, per commit: one download of the file and one pass over it for sha256 and one for the
fingerprint. Memory: the whole file, once; the file is at most the offered size (a larger object
is refused after ``size + 1`` bytes), which the grant bounded by ``storage.max_checkpoint_bytes``,
and verifications run one at a time, so concurrent commits never hold two files. With the default
limit (16 GiB) a coordinator that serves checkpoints of large models needs that much memory to
spare; lower the limit to what the run's model needs.
"""

from __future__ import annotations

import asyncio
import hashlib

from coordinator.errors import BadCheckpoint, Conflict, TooLarge
from coordinator.storage import ObjectStore
from protocol.errors import PayloadError
from protocol.fingerprint import fingerprint_safetensors
from protocol.messages import CheckpointUpload


def check_file(data: bytes, offer: CheckpointUpload) -> str | None:
    """What is wrong with ``data`` as the file ``offer`` describes; ``None`` if nothing."""
    if len(data) != offer.size:
        return f"the file holds {len(data)} bytes, not the offered {offer.size}"
    if hashlib.sha256(data).hexdigest() != offer.sha256:
        return "the file's sha256 is not the offered one"
    try:
        found = fingerprint_safetensors(data)
    except PayloadError as exc:
        return f"the file is not a checkpoint of F32 tensors ({exc})"
    if found != offer.fingerprint:
        return f"the file's tensors have fingerprint {found}, not the offered {offer.fingerprint}"
    return None


class CheckpointVerifier:
    """Reads uploaded checkpoint files back from ``store`` and checks them, one at a time."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self._one_at_a_time = asyncio.Lock()

    async def verify(self, key: str, offer: CheckpointUpload) -> None:
        """Return if the object at ``key`` is exactly the offered file; ``missing`` (409) if
        there is none, ``BadCheckpoint`` (409) if it is anything else."""
        async with self._one_at_a_time:
            try:
                data = await self.store.get_bytes(key, offer.size)
            except TooLarge:
                raise BadCheckpoint(
                    f"the file is larger than the offered {offer.size} bytes"
                ) from None
            if data is None:
                raise Conflict("missing", f"nothing was uploaded at {key}")
            loop = asyncio.get_running_loop()
            problem = await loop.run_in_executor(None, check_file, data, offer)
            del data
        if problem is not None:
            raise BadCheckpoint(problem)
