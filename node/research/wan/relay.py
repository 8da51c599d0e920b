"""A userspace TCP relay that gives a link its delay, jitter, slow start and resets.

The kernel here has ``tc tbf`` but not ``netem``, so the WAN lab shapes rates with ``tbf`` and
leaves everything about time to this relay, one process per node, run inside the node's network
namespace (``python -m node.research.wan.relay --listen 10.77.0.1:8333=10.77.1.1:8333 ...``).
Each ``--listen`` pair accepts connections on the first address and opens one upstream
connection to the second per accepted one, forwarding bytes both ways.

The model:

- **Delay, jitter, window**: per direction, in ``node.research.wan.pipe``: every chunk is
  released half a round trip (± half the jitter) later, in order, and at most a window of bytes
  is in flight, starting at 10 segments and doubling per round trip (slow start), again after
  idling.
- **Handshake**: nothing is forwarded on a new connection until one round trip after the
  client connected (its SYN and the SYN-ACK), so a request on a new connection costs two round
  trips and one on a kept-alive connection one, as over real TCP.
- **Resets**: with ``--reset-every-s P`` the relay takes a turn every uniform 0.5-1.5 P. A turn
  resets a connection that is carrying data (bytes in flight either way), chosen at random
  (seeded): ``SO_LINGER`` 0 and close on both sockets, so the client and the server each get a
  RST. With none busy, the turn arms a reset for the next chunk of data on any connection in
  one direction drawn at random: a *request* (the server never sees it) or a *response* (the
  server acted, the client never hears back, the nastier case for a retry); an armed reset not
  fired by the next turn lapses. Idle kept-alive connections are never chosen: a client drops
  those silently and opens another, so resetting them would test nothing. A RST from either
  side is passed on to the other as a RST.

Not modelled: loss and retransmission (so no congestion avoidance, no fast recovery; ``cwnd``
never shrinks but after idling), the receiver's window, reordering, packet-level queueing in
the delay (the rate is ``tbf``'s, on the veth the relay's upstream socket crosses: on the way
up the kernel's send buffer between the relay and that veth can take a few hundred kB ahead of
the shaper, which the window counts as delivered), and the handshake as the server sees it (it
accepts at once; only the client's first bytes wait).

Log lines (stderr, key=value): ``event=relay_ready`` once every listener is bound, then
``event=relay_reset`` per reset (``event=relay_reset_armed``/``_lapsed`` for
turns that found no busy connection), ``event=relay_stopped`` on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import random
import signal
import socket
import struct
import sys
from dataclasses import dataclass

from node.research.wan.pipe import Direction, LinkTiming

log = logging.getLogger("sparseloco.wan.relay")

#: The directions of a connection, as the reset log names them.
WAYS = ("request", "response")


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a RST: SO_LINGER on with a zero timeout, then close at once."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class _Connection:
    writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]  # to the client, to the server
    ways: list[Direction]  # request, response


class Relay:
    """Listeners, their live connections, and the reset schedule."""

    def __init__(self, pairs: list[tuple[str, int, str, int]], timing: LinkTiming) -> None:
        self.pairs, self.timing = pairs, timing
        self.rng = random.Random(timing.seed)
        self.live: dict[int, _Connection] = {}
        self.count = 0
        self.resets = 0
        #: The direction (index into WAYS) whose next chunk of data triggers a reset.
        self.armed: int | None = None
        self.servers: list[asyncio.Server] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._resets: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Bind every listener and start the reset schedule."""
        for host, port, up_host, up_port in self.pairs:
            handle = functools.partial(self._connection, up=(up_host, up_port))
            self.servers.append(await asyncio.start_server(handle, host, port))
        self._resets = asyncio.create_task(self._reset_loop())

    def port(self, i: int = 0) -> int:
        """The port listener ``i`` is bound to (for a listener on port 0)."""
        return int(self.servers[i].sockets[0].getsockname()[1])

    async def close(self) -> None:
        """Stop listening and resetting, close every live connection, wait for their tasks."""
        if self._resets is not None:
            self._resets.cancel()
        for server in self.servers:
            server.close()
        for conn in list(self.live.values()):
            for w in conn.writers:
                w.transport.abort()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _connection(
        self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter, up: tuple[str, int]
    ) -> None:
        self.count += 1
        cid = self.count
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        rng = random.Random(self.timing.seed * 1_000_003 + cid)
        try:
            handshake = asyncio.sleep(self.timing.rtt_ms / 1000.0)
            (u_reader, u_writer), _ = await asyncio.gather(asyncio.open_connection(*up), handshake)
        except OSError as exc:
            log.info("event=relay_connect_failed conn=%d upstream=%s:%d error=%s", cid, *up, exc)
            _reset(c_writer)
            return
        ways = [
            Direction(r, w, self.timing, rng, functools.partial(self._data, cid, way))
            for way, (r, w) in enumerate(((c_reader, u_writer), (u_reader, c_writer)))
        ]
        self.live[cid] = _Connection((c_writer, u_writer), ways)
        tasks = [asyncio.create_task(c()) for d in ways for c in (d.read_side, d.write_side)]
        try:
            await asyncio.gather(*tasks)
        except (OSError, asyncio.IncompleteReadError):
            if cid in self.live:  # one side reset or failed: the other gets a RST too
                _reset(c_writer)
                _reset(u_writer)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.live.pop(cid, None)
            for w in (c_writer, u_writer):
                w.close()

    def _data(self, cid: int, way: int) -> None:
        if self.armed == way:
            self.armed = None
            self.reset(cid, WAYS[way])

    def reset(self, cid: int, during: str) -> None:
        """Reset connection ``cid`` on both sides (a RST to the client and to the server)."""
        conn = self.live.pop(cid, None)
        if conn is None:
            return
        self.resets += 1
        for w in conn.writers:
            _reset(w)
        log.info(
            "event=relay_reset conn=%d during=%s resets=%d live=%d",
            cid,
            during,
            self.resets,
            len(self.live),
        )

    async def _reset_loop(self) -> None:
        period = self.timing.reset_every_s
        if period is None:
            return
        while True:
            await asyncio.sleep(self.rng.uniform(0.5 * period, 1.5 * period))
            if self.armed is not None:
                log.info("event=relay_reset_lapsed way=%s", WAYS[self.armed])
                self.armed = None
            busy = sorted(cid for cid, c in self.live.items() if any(w.busy for w in c.ways))
            if busy:
                self.reset(self.rng.choice(busy), "transfer")
            else:
                self.armed = self.rng.randrange(len(WAYS))
                log.info("event=relay_reset_armed way=%s live=%d", WAYS[self.armed], len(self.live))


def parse_pair(text: str) -> tuple[str, int, str, int]:
    """``HOST:PORT=UPHOST:UPPORT`` as a tuple; ValueError naming the expected form."""
    try:
        listen, upstream = text.split("=")
        host, port = listen.rsplit(":", 1)
        up_host, up_port = upstream.rsplit(":", 1)
        return host, int(port), up_host, int(up_port)
    except ValueError:
        raise ValueError(f"{text!r}: expected HOST:PORT=UPHOST:UPPORT") from None


async def serve(pairs: list[tuple[str, int, str, int]], timing: LinkTiming) -> None:
    """Run until SIGTERM or SIGINT."""
    relay = Relay(pairs, timing)
    await relay.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    listen = ",".join(f"{h}:{p}={uh}:{up}" for h, p, uh, up in pairs)
    log.info("event=relay_ready listen=%s rtt_ms=%g jitter_ms=%g", listen, *_ms(timing))
    await stop.wait()
    await relay.close()
    log.info("event=relay_stopped connections=%d resets=%d", relay.count, relay.resets)


def _ms(timing: LinkTiming) -> tuple[float, float]:
    return timing.rtt_ms, timing.jitter_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.research.wan.relay")
    parser.add_argument("--listen", nargs="+", required=True, metavar="HOST:PORT=UPHOST:UPPORT")
    parser.add_argument("--rtt-ms", type=float, default=0.0)
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--reset-every-s", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        pairs = [parse_pair(p) for p in args.listen]
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
    timing = LinkTiming(args.rtt_ms, args.jitter_ms, args.reset_every_s, args.seed)
    asyncio.run(serve(pairs, timing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
