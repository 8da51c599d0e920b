"""Group commit: every answer waits until the state it reflects is on disk, with one fsync for
many commits, and the fsync off the event loop.

SQLite with ``synchronous=FULL`` fsyncs its write-ahead log inside every commit, on the thread
that commits: here the event loop. At a few milliseconds an fsync, a burst of a thousand
submissions and reports holds every other request (heartbeats first) for seconds. The server's
database therefore commits with ``synchronous=NORMAL`` (the log is written, not yet synced) and
this class restores the promise "nothing a node was told is lost, even if the machine crashes":
``barrier()`` returns once every change committed before the call is durable. One fsync of the
log file, in a thread of its own, covers every commit made before it started; requests arriving
while it runs wait for the next one, which then covers them all.

A crash of the process alone loses nothing either way (the log's pages are in the kernel); this
is about the machine. Answers that change nothing do not wait when nothing is pending, and a
submission's answer does not wait at all: a node re-sends a submission the coordinator lost
(``coordinator.api.handling.SELF_REPAIRED``).

Checkpoints (copying the log into the main file, two more fsyncs) run on the same thread, on a
connection of its own, once the log passes ``CHECKPOINT_BYTES``: the server's connection has
automatic checkpoints off, so no commit on the event loop ever stalls on one.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coordinator.state.db import Database

#: Size of the write-ahead log past which the sync thread checkpoints it (SQLite's own default
#: is 1000 pages, about this much).
CHECKPOINT_BYTES = 4 * 1024 * 1024


class GroupSync:
    """Makes the commits of one ``Database`` (opened with ``durable=False``) durable in groups."""

    def __init__(self, db: Database) -> None:
        self.db = db
        #: The write-ahead log SQLite appends commits to (``PRAGMA journal_mode=WAL``).
        self.wal = Path(f"{db.path}-wal")
        #: ``Database.changes`` as of the last fsync: every change up to it is on disk.
        self.synced = db.changes
        self._flight: asyncio.Future[None] | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="fsync")
        self.syncs = 0  # how many fsyncs ran (tests, metrics)
        self.checkpoints = 0
        self._conn: sqlite3.Connection | None = None  # the sync thread's own connection

    def pending(self) -> bool:
        """Whether some committed change is not known to be on disk yet."""
        return self.db.changes != self.synced

    async def barrier(self) -> None:
        """Return once every change committed so far is on disk."""
        target = self.db.changes
        while self.synced < target:
            if self._flight is None:
                self._flight = asyncio.ensure_future(self._sync())
            await asyncio.shield(self._flight)

    async def _sync(self) -> None:
        covered = self.db.changes  # everything committed before the fsync starts
        try:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._fsync)
            self.synced = max(self.synced, covered)
            self.syncs += 1
        finally:
            self._flight = None

    def _fsync(self) -> None:
        # Commits live in the log until a checkpoint copies them (and syncs) the main file; the
        # log exists while the database is open, but fall back to the main file if it does not.
        for path in (self.wal, self.db.path):
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if path == self.wal and size > CHECKPOINT_BYTES:
                self._checkpoint()
            return

    def _checkpoint(self) -> None:
        """(sync thread) Copy the log into the main file; writers carry on meanwhile."""
        if self._conn is None:
            self._conn = sqlite3.connect(self.db.path, isolation_level=None)
        self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        self.checkpoints += 1

    def close(self) -> None:
        """Close the thread's connection (on that thread) and the thread."""
        if self._conn is not None:
            self._executor.submit(self._conn.close).result()
            self._conn = None
        self._executor.shutdown(wait=True)
