"""One direction of one relayed connection: delay, jitter and a slow-starting window.

The relay (``node.research.wan.relay``) terminates TCP on both sides, so the kernels see
loopback and a veth with no delay and would fill any link at once; each direction of each
connection it forwards is a ``Direction``, which gives the bytes the time a real path would:

- **Delay**: every chunk read is released ``rtt/2`` later, plus a uniform jitter of ± half of
  ``jitter_ms``, so a round trip varies by ± ``jitter_ms``. Release times never go backwards
  (a chunk waits for the one before it), which keeps the byte order of the stream and turns
  jitter into occasional extra delay, as a FIFO queue on a real path does.
- **Window** (the bandwidth-delay effect): at most ``cwnd`` bytes are in flight: read from
  the sender but not yet acknowledged, an acknowledgement coming back one way-delay after the
  chunk was handed on (written and drained into the next socket). ``cwnd`` starts at 10
  segments (``INIT_WINDOW``, RFC 6928), grows by each acknowledged byte (slow start: doubling
  per round trip) up to ``MAX_WINDOW``, and starts again from 10 segments after an idle spell
  longer than a retransmission timeout (Linux's ``tcp_slow_start_after_idle``). A long round
  trip therefore really slows a short transfer and caps a long one at ``MAX_WINDOW / rtt``.

What this leaves out is listed in the relay's docstring.
"""

from __future__ import annotations

import asyncio
import collections
import random
from dataclasses import dataclass

#: Bytes of one TCP segment's payload on an Ethernet path.
MSS = 1460
#: Initial congestion window (RFC 6928: 10 segments).
INIT_WINDOW = 10 * MSS
#: Largest window: Linux's default maximum receive buffer is about this (tcp_rmem's 6 MiB
#: with a quarter kept for overhead), so a real path is capped near it too.
MAX_WINDOW = 4 * 1024 * 1024
#: Largest chunk read at once.
CHUNK = 64 * 1024
#: Lower bound of the retransmission timeout (Linux TCP_RTO_MIN), after which an idle
#: connection's window starts again from INIT_WINDOW.
RTO_MIN_S = 0.2


@dataclass(frozen=True)
class LinkTiming:
    """What the relay adds to every connection."""

    rtt_ms: float
    jitter_ms: float = 0.0
    reset_every_s: float | None = None
    seed: int = 0

    def one_way_s(self, rng: random.Random) -> float:
        half = self.rtt_ms / 2000.0
        spread = self.jitter_ms / 2000.0
        return max(0.0, half + rng.uniform(-spread, spread)) if spread else half


class Direction:
    """One direction of one connection: read, delay, forward, within the window."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        timing: LinkTiming,
        rng: random.Random,
        on_data: collections.abc.Callable[[], None],
    ) -> None:
        self.reader, self.writer, self.timing, self.rng = reader, writer, timing, rng
        self.on_data = on_data
        self.cwnd = INIT_WINDOW
        self.inflight = 0
        self.bytes = 0
        self.last_active = asyncio.get_running_loop().time()
        self.window_open = asyncio.Event()
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = asyncio.Event()
        self.rto_s = max(RTO_MIN_S, 1.5 * timing.rtt_ms / 1000.0)

    async def read_side(self) -> None:
        loop = asyncio.get_running_loop()
        release = 0.0
        carry = b""  # read from the socket, not yet let into the window
        while True:
            if not carry:
                carry = await self.reader.read(CHUNK)
                if not carry:
                    break
                if self.inflight == 0 and loop.time() - self.last_active > self.rto_s:
                    self.cwnd = min(self.cwnd, INIT_WINDOW)  # slow start again after idling
            space = self.cwnd - self.inflight
            if space <= 0:
                self.window_open.clear()
                await self.window_open.wait()
                continue
            data, carry = carry[:space], carry[space:]
            now = loop.time()
            release = max(release, now + self.timing.one_way_s(self.rng))
            self.queue.append((release, data))
            self.queued.set()
            self.on_data()
            self.inflight += len(data)
            self.bytes += len(data)
            self.last_active = now
        # EOF: the writer passes it on in order, after the last bytes.
        self.queue.append((max(release, loop.time() + self.timing.one_way_s(self.rng)), b""))
        self.queued.set()

    @property
    def busy(self) -> bool:
        """Bytes read and not yet acknowledged, or waiting for their release."""
        return self.inflight > 0 or bool(self.queue)

    async def write_side(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.queue:
                self.queued.clear()
                await self.queued.wait()
            release, data = self.queue.popleft()
            delay = release - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if not data:
                if self.writer.can_write_eof():
                    self.writer.write_eof()
                return
            self.writer.write(data)
            await self.writer.drain()
            loop.call_later(self.timing.one_way_s(self.rng), self._ack, len(data))

    def _ack(self, n: int) -> None:
        self.inflight -= n
        self.cwnd = min(MAX_WINDOW, self.cwnd + n)
        self.last_active = asyncio.get_running_loop().time()
        self.window_open.set()
