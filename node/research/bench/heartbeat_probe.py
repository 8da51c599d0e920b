"""The heartbeat probe of ``sparseloco bench coordinator``: heartbeats timed from a process of
their own.

Every request of a member counts as its heartbeat, so the simulated nodes send a heartbeat only
into a silence, a few a run: the heartbeat target (p99 < 100 ms) would be judged on almost no
samples. The probe sends one every ``PROBE_S`` for a random member, with that member's token and
process id and no condition (so it changes nothing the coordinator holds but the time it last
heard from it), and times the answer. It runs in its own process, as a real node does: timed in
the load generator's event loop, which runs the N simulated nodes and lags 50-100 ms at p99
under load, each heartbeat would carry that lag too. Answers other than 200 (a node not a
member yet, or finished) are not timed.
"""

from __future__ import annotations

import asyncio
import random
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

import aiohttp

from protocol.routes import ROUTES

#: Seconds between two heartbeats of the probe: ~20 requests a second, a small share of the load.
PROBE_S = 0.05


async def _beat(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], took: list[float]
) -> None:
    start = time.monotonic()
    try:
        async with session.post(url, headers=headers) as resp:
            await resp.read()
            if resp.status == 200:
                took.append(time.monotonic() - start)
    except (aiohttp.ClientError, TimeoutError):
        pass  # the nodes' own requests count the coordinator's errors


async def _probe(
    url: str, members: list[dict[str, str]], stop: Event, out: Connection
) -> list[float]:
    took: list[float] = []
    pending: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        out.send("ready")  # the load generator starts its nodes now
        while not stop.is_set():
            await asyncio.sleep(PROBE_S)
            task = asyncio.create_task(_beat(session, url, random.choice(members), took))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
    return took


def run(base_url: str, members: list[dict[str, str]], stop: Event, out: Connection) -> None:
    """(the probe process) Say "ready" on ``out``, heartbeat until ``stop`` is set, then send
    the latencies (s) to ``out``."""
    url = base_url + ROUTES["heartbeat"].url(None)
    out.send(asyncio.run(_probe(url, members, stop, out)))
    out.close()
