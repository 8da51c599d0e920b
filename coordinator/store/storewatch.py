"""The object store as the coordinator sees it: up, or down since when; deadlines pause while down.

The coordinator touches the store when it checks a submission (a HEAD), publishes a manifest or a
checkpoint sidecar, verifies a checkpoint, reads a dataset manifest and prunes old rounds.
``WatchedStore`` wraps the store so every one of those calls reports its outcome to
``StoreWatch``; a probe (a HEAD of ``PROBE_KEY`` in the run's folder, which need not exist)
every ``PROBE_S`` seconds, and every ``DOWN_PROBE_S`` while the store is down, makes sure an
outage is seen even when no node can submit, and its end is seen soon.

While the store is down no round closes on its deadline (nodes cannot deliver payloads, and the
coordinator could not check them); when it answers again the open round's deadline moves later
by the time the outage took from it (``coordinator.rules.deadlines``). The outage itself, with its
cause, is the store link's pair of lines (``event=unreachable service=store`` ...,
``event=reachable service=store`` ...: ``S3Store.link``); what it does to the round is one line
when the deadline pauses and one when it runs again::

    event=deadline_paused round=3 why=store_unreachable
    event=deadline_resumed round=3 paused_s=61.2 deadline_extended_s=61.2

Only failures that mean "not answering" count: a connection error, a timeout, a 5xx, throttling.
A 404 or a refusal (403) is an answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from coordinator.base.errors import StorageError
from coordinator.rules.machine import RoundMachine
from coordinator.store.object_store import READ_CHUNK, Consumer, ObjectInfo, ObjectStore

log = logging.getLogger("sparseloco.coordinator.storewatch")

T = TypeVar("T")

#: Seconds between probes of a store that answers, and of one that does not.
PROBE_S = 5.0
DOWN_PROBE_S = 1.0
#: Characters of the store's error message a log line keeps (``StorageError`` messages name
#: the operation and the failure, never a presigned URL or a credential).
ERROR_CHARS = 160
#: The probe's key under the run's folder (``protocol.keys.run_prefix``); it need not exist
#: (a 404 is an answer), and nothing writes it.
PROBE_KEY = "coordinator-probe"
#: Store error codes that mean it is not answering (besides no code at all: no answer).
UNAVAILABLE = frozenset(
    {"500", "502", "503", "504", "InternalError", "ServiceUnavailable", "SlowDown"}
    | {"RequestTimeout"}
)


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` means the store did not answer (rather than answered with a refusal)."""
    if isinstance(exc, StorageError):
        return exc.code is None or exc.code in UNAVAILABLE
    return isinstance(exc, OSError | TimeoutError)


class StoreWatch:
    """Up or down, with the round machine's deadlines paused while down."""

    def __init__(self, machine: RoundMachine, clock: Callable[[], float] = time.monotonic) -> None:
        self.machine = machine
        self.clock = clock
        self.down_since: float | None = None

    @property
    def up(self) -> bool:
        return self.down_since is None

    def failed(self, what: str, exc: BaseException) -> None:
        if not unavailable(exc) or self.down_since is not None:
            return
        self.down_since = self.clock()
        round_ = self.machine.store_down()
        if round_ is not None:
            log.info("event=deadline_paused round=%d why=store_unreachable", round_)
        log.debug("event=store_watch_down what=%r error=%r", what, str(exc)[:ERROR_CHARS])

    def answered(self) -> None:
        if self.down_since is None:
            return
        after = self.clock() - self.down_since
        self.down_since = None
        moved = self.machine.store_back()
        if moved is not None:
            log.info(
                "event=deadline_resumed round=%d paused_s=%.1f deadline_extended_s=%.1f",
                moved[0], after, moved[1],
            )  # fmt: skip

    async def watched(self, what: str, call: Awaitable[T]) -> T:
        """``call``'s result, its outcome reported."""
        try:
            out = await call
        except Exception as exc:
            if unavailable(exc):
                self.failed(what, exc)
            else:
                self.answered()
            raise
        self.answered()
        return out

    async def probe_forever(self, store: ObjectStore, run_folder: str) -> None:
        """HEAD ``PROBE_KEY`` every ``PROBE_S`` (``DOWN_PROBE_S`` while down) through the
        watched ``store``, until cancelled."""
        while True:
            await asyncio.sleep(PROBE_S if self.up else DOWN_PROBE_S)
            with contextlib.suppress(Exception):  # the watch heard of it
                await store.head(run_folder + PROBE_KEY)


class WatchedStore:
    """An ``ObjectStore`` that reports every network call's outcome to a ``StoreWatch``."""

    def __init__(self, store: ObjectStore, watch: StoreWatch) -> None:
        self.inner = store
        self.watch = watch

    def presign_put(self, key: str, size: int, sha256_hex: str) -> tuple[str, dict[str, str]]:
        return self.inner.presign_put(key, size, sha256_hex)

    def presign_get(self, key: str) -> str:
        return self.inner.presign_get(key)

    async def head(self, key: str) -> ObjectInfo | None:
        return await self.watch.watched(f"head {key}", self.inner.head(key))

    async def sizes(self, prefix: str) -> dict[str, int]:
        return await self.watch.watched(f"list {prefix}", self.inner.sizes(prefix))

    async def put_bytes(self, key: str, data: bytes) -> None:
        await self.watch.watched(f"put {key}", self.inner.put_bytes(key, data))

    async def get_bytes(self, key: str, max_size: int) -> bytes | None:
        return await self.watch.watched(f"get {key}", self.inner.get_bytes(key, max_size))

    async def read_chunks(
        self, key: str, max_size: int, consume: Consumer, *, chunk_bytes: int = READ_CHUNK
    ) -> bool:
        read = self.inner.read_chunks(key, max_size, consume, chunk_bytes=chunk_bytes)
        return await self.watch.watched(f"read {key}", read)

    async def delete_keys(self, keys: list[str]) -> int:
        return await self.watch.watched("delete", self.inner.delete_keys(keys))

    async def delete_prefix(self, prefix: str) -> int:
        return await self.watch.watched(f"delete {prefix}", self.inner.delete_prefix(prefix))

    async def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            await close()
