"""What keeps a running node a member of the run, and how a stop request ends its work.

- ``heartbeat``: beats into the coordinator's silences. A request that said the node's
  condition already counts as a beat, so a beat goes out only ``heartbeat_interval_s`` after
  the last one the coordinator counted, or soon after the condition changed. A token the
  coordinator stopped accepting (401, or ``token_in_use``) is learnt within one interval and
  handed to ``refuse``; a coordinator that forgot the node (``not_member``) is joined again.
- ``until_stopped``: any wait that a stop request cuts short (its work cancelled).
- ``with_grace``: the round loop under a stop request: the round in hand may finish for the
  settings' grace, then it is cut (everything on disk is consistent at any point, and a
  restart continues from there); a refused node is cut at once.

Each takes the few things it uses (the coordinator seam, the clock, the stop flag), not the
daemon (``node.daemon.loop``), which wires them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from node.daemon.api import Clock, CoordinatorApi
from node.daemon.condition import Condition
from node.daemon.join import refusal, rejoin
from node.errors import Abandoned, CoordinatorError, Refused
from protocol.causes import cause
from protocol.errors import SparseLoCoError

T = TypeVar("T")


async def heartbeat(
    api: CoordinatorApi,
    condition: Condition,
    clock: Clock,
    *,
    interval: float,
    manifest_key: str,
    stopping: asyncio.Event,
    refuse: Callable[[Refused], None],
    log: Callable[..., None],
) -> None:
    """Beat until cancelled, or until the coordinator refuses the node (``refuse`` is told);
    ``manifest_key``: the key a rejoin must find again."""
    wait = interval
    while True:
        await condition.due(clock, wait)
        heard = api.heard()
        if heard and heard.age_s < interval and heard.condition == condition.now():
            wait = interval - heard.age_s  # a request said it all: beat into the silence
            continue
        wait = interval
        try:
            await api.heartbeat(condition.now())
        except CoordinatorError as exc:
            if exc.status == 401 or exc.error == "token_in_use":
                refuse(refusal(exc))  # revoked: out within one heartbeat interval
                return
            if exc.error == "not_member" and not stopping.is_set():
                log("rejoin")
                with contextlib.suppress(SparseLoCoError):
                    await rejoin(api, manifest_key)
        except SparseLoCoError as exc:
            log("heartbeat_failed", cause=repr(cause(exc)))


async def until_stopped(stopping: asyncio.Event, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (``work`` cancelled) if ``stopping`` is set first."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return task.result() if not task.cancelled() else None


async def with_grace(
    loop: Coroutine[Any, Any, bool],
    stopping: asyncio.Event,
    grace_s: float,
    *,
    refused: Callable[[], bool],
    on_cut: Callable[[], None],
) -> bool:
    """Run the round ``loop``: its result (True: the run finished), or False after a stop.

    A stop lets the round in hand finish for ``grace_s``, then cuts it (``on_cut`` is called
    first, unless the node was ``refused``: a refused node gets no grace and no more lines).
    """
    rounds = asyncio.create_task(loop, name="rounds")
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({rounds, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not rounds.done() and not refused():
            await asyncio.wait({rounds}, timeout=grace_s)
        if not rounds.done():
            if not refused():  # a refused node's one line is its refusal
                on_cut()
            rounds.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rounds
            return False
        try:
            return rounds.result()
        except Abandoned:  # stopped while it waited for the store (a checkpoint)
            return False
    finally:
        stop.cancel()
        if not rounds.done():
            rounds.cancel()
