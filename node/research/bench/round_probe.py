"""The light client of ``sparseloco bench coordinator``: ``GET /v1/round`` timed from a process of
its own.

A round view is the cheapest answer the coordinator gives (a read of what it holds in memory),
so its latency is the event loop's own delay: a stall of the loop (a commit, a round's close, a
garbage collection) shows here whole, where the nodes' latencies mix it with their own work.
The probe asks every ``PROBE_S`` whatever became of the previous request, with the token of a
random member and no condition or process header (so the request counts as nothing but a
read), and times the answer. It runs in a process of its own so that the load generator's busy
loop is not inside what it times. Answers other than 200 are not timed.

With each answer it records the CPU the coordinator's process used while the request waited
(from ``/proc``, in clock ticks of 10 ms): an answer that took 600 ms while the coordinator
used 40 ms of CPU waited for a core (other processes on the machine), not for the
coordinator's own work.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path

import aiohttp

from protocol.routes import ROUTES

#: Seconds between two requests of the probe: 5 a second, a light client's pace.
PROBE_S = 0.2


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _ask(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], pid: int,
    took: list[list[float]],
) -> None:  # fmt: skip
    sent, start, cpu = time.time(), time.monotonic(), cpu_s(pid)
    try:
        async with session.get(url, headers=headers) as resp:
            await resp.read()
            if resp.status == 200:
                took.append([sent, time.monotonic() - start, cpu_s(pid) - cpu])
    except (aiohttp.ClientError, TimeoutError):
        pass  # the nodes' own requests count the coordinator's errors


async def _probe(
    url: str, members: list[dict[str, str]], pid: int, stop: Event, out: Connection
) -> list[list[float]]:
    took: list[list[float]] = []
    pending: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        out.send("ready")
        while not stop.is_set():
            await asyncio.sleep(PROBE_S)
            task = asyncio.create_task(_ask(session, url, random.choice(members), pid, took))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
    return took


def run(
    base_url: str, members: list[dict[str, str]], pid: int, stop: Event, out: Connection
) -> None:
    """(the probe process) Say "ready" on ``out``, ask for the round until ``stop`` is set,
    then send ``[time sent (s since the epoch), latency s, coordinator CPU s meanwhile]`` per
    answer to ``out``. ``members`` are the nodes' headers (only their ``Authorization`` is
    sent); ``pid`` is the coordinator's process."""
    url = base_url + ROUTES["round"].url(None)
    auth = [{"Authorization": m["Authorization"]} for m in members]
    out.send(asyncio.run(_probe(url, auth, pid, stop, out)))
    out.close()
