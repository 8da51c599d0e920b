"""The object store as every part of the coordinator sees it: a small Protocol and its values.

The coordinator never moves payloads itself. It presigns a PUT that only accepts the announced
size and sha256 and only once (``If-None-Match: *``), presigns GETs, checks uploads with HEAD,
writes the signed manifests and checkpoint sidecars, and deletes what the retention policy no
longer needs. The objects it reads back are an uploaded checkpoint, to verify it before it is
committed (``read_chunks``: streamed in bounded chunks to a consumer, never held whole), and a
dataset's small manifest (``get_bytes``); both are bounded by the caller's size limit.

``ObjectStore`` is that seam; ``coordinator.store.storage.S3Store`` implements it on any
S3-compatible endpoint, ``coordinator.store.storewatch.WatchedStore`` wraps one to watch for
outages. Every failure leaves it as ``coordinator.base.errors.StorageError``.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from coordinator.base.errors import StorageError
from protocol.causes import cause

T = TypeVar("T")

#: S3 error codes of a HEAD on a key that does not exist (AWS, MinIO, SeaweedFS, R2 differ).
NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})
#: Bytes ``read_chunks`` hands its consumer at a time (its memory, whatever the object's size).
READ_CHUNK = 1 << 20

#: What ``read_chunks`` hands each piece of an object to, in order.
Consumer = Callable[[bytes], None]


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    sha256_b64: str | None  # the stored checksum when the store keeps one


def sha256_b64(sha256_hex: str) -> str:
    """The base64 form of a hex sha256, as the ``x-amz-checksum-sha256`` header carries it."""
    return base64.b64encode(bytes.fromhex(sha256_hex)).decode()


async def unless_missing(call: Awaitable[T]) -> T | None:
    """What ``call`` returns, or ``None`` where the store answers that the key does not exist."""
    try:
        return await call
    except StorageError as exc:
        if exc.code in NOT_FOUND:
            return None
        raise


def retry_logged(logger: logging.Logger, event: str, retry_in_s: float, exc: BaseException) -> None:
    """A background write that will be tried again. An unreachable store was logged once by its
    link (``S3Store.link``): each retry of it then only at DEBUG; a refusal (credentials, a
    full bucket) is a WARNING every time, with its cause in a few words."""
    logger.debug("event=%s retry_in_s=%.1f error=%r", event, retry_in_s, exc)
    if not getattr(exc, "unreachable", False):
        logger.warning("event=%s retry_in_s=%.1f cause=%r", event, retry_in_s, cause(exc))


class ObjectStore(Protocol):
    def presign_put(self, key: str, size: int, sha256_hex: str) -> tuple[str, dict[str, str]]:
        """A URL and the exact headers for one write of ``size`` bytes hashing to ``sha256``."""
        ...

    def presign_get(self, key: str) -> str: ...

    async def head(self, key: str) -> ObjectInfo | None:
        """Size and checksum of ``key``, or ``None`` if it does not exist."""
        ...

    async def sizes(self, prefix: str) -> dict[str, int]:
        """Every object whose key starts with ``prefix``: key -> size (a listing)."""
        ...

    async def put_bytes(self, key: str, data: bytes) -> None: ...

    async def get_bytes(self, key: str, max_size: int) -> bytes | None:
        """The whole object at ``key``, ``None`` if it does not exist; ``TooLarge`` (and no more
        than ``max_size + 1`` bytes read) if it holds more than ``max_size`` bytes."""
        ...

    async def read_chunks(
        self, key: str, max_size: int, consume: Consumer, *, chunk_bytes: int = READ_CHUNK
    ) -> bool:
        """Stream the object at ``key`` to ``consume``, in order, in pieces of at most
        ``chunk_bytes``, off the event loop (``consume`` runs on that thread too); False if it
        does not exist. ``TooLarge`` (and no more than ``max_size + 1`` bytes read) if it holds
        more than ``max_size`` bytes; an exception of ``consume`` ends the read and propagates."""
        ...

    async def delete_keys(self, keys: list[str]) -> int:
        """Delete ``keys`` (absent ones are no error); how many were asked to go."""
        ...

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix``; how many there were."""
        ...
