"""Long-polls released by one event, woken a batch at a time so the loop keeps serving.

When a round closes, nearly every member is long-polling its manifest (and when a waiting round
opens, its round). Woken together by one ``asyncio.Event``, they all become runnable in the same
turn of the event loop, and the loop answers every one of them before it reads another request:
a heartbeat that arrives just then waits behind a thousand answers (0.1-0.2 s at a thousand
nodes on a small, busy machine). ``Wakeups`` wakes ``BATCH`` waiters per turn instead; between
two batches the loop reads its sockets, so a request arriving meanwhile waits for at most about
one batch, and the last long-poll is answered a few milliseconds later than it would have been.
Waiters are woken in the order they started waiting.
"""

from __future__ import annotations

import asyncio
import contextlib

#: Waiters woken per turn of the event loop.
BATCH = 32


class Wakeups:
    """Waiters keyed by a round number; ``release`` wakes one round's waiters in batches."""

    def __init__(self, batch: int = BATCH) -> None:
        self.batch = batch
        #: round -> its waiters' futures, in arrival order (a dict: removal is O(1))
        self._waiting: dict[int, dict[asyncio.Future[None], None]] = {}
        self._draining: set[asyncio.Task[None]] = set()  # kept referenced until done

    def keys(self) -> list[int]:
        """The rounds someone is waiting for."""
        return list(self._waiting)

    async def wait(self, key: int, timeout: float) -> None:
        """Return when ``key`` is released, or after ``timeout`` seconds."""
        if timeout <= 0:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters = self._waiting.setdefault(key, {})
        waiters[future] = None
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await future
        finally:
            waiters.pop(future, None)
            if not waiters and self._waiting.get(key) is waiters:
                del self._waiting[key]

    def release(self, key: int) -> None:
        """Wake every waiter of ``key``: the first batch now, the rest one batch per turn."""
        waiters = list(self._waiting.pop(key, {}))
        _wake(waiters[: self.batch])
        if len(waiters) > self.batch:
            task = asyncio.get_running_loop().create_task(self._drain(waiters[self.batch :]))
            self._draining.add(task)
            task.add_done_callback(self._draining.discard)

    async def _drain(self, waiters: list[asyncio.Future[None]]) -> None:
        for start in range(0, len(waiters), self.batch):
            await asyncio.sleep(0)  # one turn: the loop reads its sockets between batches
            _wake(waiters[start : start + self.batch])

    def release_all(self) -> None:
        """Wake every waiter now (the server is stopping)."""
        for key in self.keys():
            _wake(list(self._waiting.pop(key)))


def _wake(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)
