"""The WAN lab's links are what their profiles say (``node.research.wan``).

Two layers. The relay alone, on loopback (no root needed): bytes arrive whole and in order
under jitter, a request costs the round trips TCP would (two on a new connection, one on a
kept-alive one), a fresh connection starts slow, and a reset period resets live connections on
both sides. Then the whole lab (root; skipped with ``WanLab.available()``'s reason elsewhere):
throughput each way through ``home``, round trips through ``home`` and ``far``, resets through
``flaky``, and no namespace left behind. The lab's numbers are printed (``-s`` shows them);
only coarse facts are asserted, since the machine's load stretches every time: delays are
lower bounds (the relay never releases a byte early), rates upper bounds (``tbf`` never lets
more through, give or take its burst), and the asymmetry of ``home`` (20 up, 100 down) is a
factor of 5 of which a factor of 2 is required.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

import pytest

from node.research.wan import measure
from node.research.wan.lab import WanLab
from node.research.wan.netns import PREFIX, probe, remove_leftovers, run
from node.research.wan.pipe import INIT_WINDOW, LinkTiming
from node.research.wan.profiles import PROFILES, LinkProfile
from node.research.wan.relay import Relay, parse_pair

needs_lab = pytest.mark.skipif(
    WanLab.available() is not None, reason=f"WAN lab unavailable: {WanLab.available()}"
)


def test_the_profiles_are_the_issues_links() -> None:
    home, flaky = PROFILES["home"], PROFILES["flaky"]
    assert (home.up_mbit, home.down_mbit, home.rtt_ms) == (20, 100, 40)
    assert (PROFILES["office"].up_mbit, PROFILES["office"].rtt_ms) == (100, 20)
    assert (PROFILES["far"].rtt_ms, PROFILES["far"].jitter_ms) == (150, 30)
    assert flaky.reset_every_s == 60 and flaky.with_reset(5).reset_every_s == 5
    assert (flaky.up_mbit, flaky.down_mbit, flaky.rtt_ms) == (20, 100, 40)
    with pytest.raises(ValueError, match="jitter"):
        LinkProfile("bad", 1, 1, rtt_ms=10, jitter_ms=20)
    assert parse_pair("10.0.0.1:80=10.0.0.2:8080") == ("10.0.0.1", 80, "10.0.0.2", 8080)
    with pytest.raises(ValueError, match="HOST:PORT=UPHOST:UPPORT"):
        parse_pair("10.0.0.1:80")


def test_without_root_the_lab_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = probe.__wrapped__()  # the uncached probe: this process may well be root
    assert reason is not None and "needs root" in reason


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()
    except ConnectionError:
        writer.transport.abort()


async def _relayed(timing: LinkTiming) -> tuple[asyncio.Server, Relay, int]:
    """An echo server behind a relay on loopback; the relay's port."""
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    up_port = echo.sockets[0].getsockname()[1]
    relay = Relay([("127.0.0.1", 0, "127.0.0.1", up_port)], timing)
    await relay.start()
    return echo, relay, relay.port()


async def _close(echo: asyncio.Server, relay: Relay, writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()
    await relay.close()
    echo.close()
    await echo.wait_closed()


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> float:
    t0 = time.monotonic()
    writer.write(b"x" * n)
    await reader.readexactly(n)
    return time.monotonic() - t0


def test_the_relay_delays_in_order_and_starts_slow() -> None:
    """Jitter keeps the byte order; a request costs its round trips; 600 kB on a new
    connection, and again after idling, need the round trips of slow start."""

    async def main() -> None:
        rtt = 0.1
        echo, relay, port = await _relayed(LinkTiming(rtt_ms=100, jitter_ms=40, seed=3))
        t0 = time.monotonic()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await _exchange(reader, writer, 1)
        first = time.monotonic() - t0  # handshake + a round trip: two, less the jitter
        kept = [await _exchange(reader, writer, 1) for _ in range(3)]
        blob = random.Random(0).randbytes(600_000)  # 600 kB: 6 round trips of slow start
        t0 = time.monotonic()
        writer.write(blob)
        back = await reader.readexactly(len(blob))
        slow = time.monotonic() - t0
        await asyncio.sleep(0.3)  # idle past the retransmission timeout: slow start again
        t0 = time.monotonic()
        writer.write(blob)
        await reader.readexactly(len(blob))
        again = time.monotonic() - t0
        await _close(echo, relay, writer)
        assert back == blob, "the relay reordered or lost bytes"
        assert first >= 2 * rtt - 0.04
        assert min(kept) >= rtt - 0.04
        # 14.6 kB, then doubling per round trip each way: at least 5 round trips for 600 kB.
        assert len(blob) > INIT_WINDOW * (2**5 - 1)
        assert slow >= 5 * (rtt - 0.04), slow
        assert again >= 5 * (rtt - 0.04), again

    asyncio.run(main())


def test_the_relay_resets_live_connections_on_both_sides() -> None:
    async def main() -> None:
        echo, relay, port = await _relayed(LinkTiming(rtt_ms=10, reset_every_s=0.3, seed=1))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with pytest.raises(ConnectionResetError):
            for _ in range(200):  # 0.15-0.45 s until the reset; 4 s at most
                await _exchange(reader, writer, 10)
                await asyncio.sleep(0.02)
        assert relay.resets >= 1
        await _close(echo, relay, writer)

    asyncio.run(main())


@needs_lab
def test_the_lab_shapes_each_link_as_its_profile(tmp_path: Path) -> None:
    with WanLab(tmp_path / "lab") as lab, measure.ProbeServer(lab) as probe:
        lab.expose(probe.port)
        home = lab.add_node("home", PROFILES["home"])
        far = lab.add_node("far", PROFILES["far"])
        flaky = lab.add_node("flaky", PROFILES["flaky"].with_reset(1.0))
        # Processes started in the lab: one in the server namespace (stopped when the lab
        # closes), one in a node's that reaches the server by the service address.
        sleeper = lab.server_run(["sleep", "600"])
        dial = f"import socket; socket.create_connection(({lab.service_ip!r}, {probe.port}), 10)"
        assert home.popen([sys.executable, "-c", dial]).wait(timeout=60) == 0
        up = measure.upload_mbit(lab, home, probe.port, 3_000_000)
        down = measure.download_mbit(lab, home, probe.port, 8_000_000)
        trips = {h.name: measure.round_trips(lab, h, probe.port, 5) for h in (home, far)}
        # Two connections in turn, each held until a reset ends it (0.5-1.5 s on average).
        lived = [measure.held_until_reset(lab, flaky, probe.port, limit_s=10.0) for _ in "ab"]
        rtt = {name: statistics.median(times) for name, (_, times) in trips.items()}
        print(
            f"\nwan_lab home up_mbit={up:.1f} down_mbit={down:.1f}"
            f" rtt_ms home={rtt['home'] * 1e3:.0f} far={rtt['far'] * 1e3:.0f}"
            f" first_request_ms home={trips['home'][0] * 1e3:.0f} far={trips['far'][0] * 1e3:.0f}"
            f" flaky_reset_after_s={lived}"
        )
        assert up < 20 * 1.2, "the upload beat its 20 Mbit/s shaper"
        assert down > 2 * up, f"home is not asymmetric: {up:.1f} up, {down:.1f} down"
        assert rtt["home"] >= 0.035
        assert rtt["far"] >= rtt["home"] + 0.08  # 150 ± 30 against 40
        assert trips["far"][0] >= 2 * 0.12  # a new connection: the handshake's round trip too
        assert None not in lived and lab.resets("flaky") >= 2
        assert {lab.server, lab.bridge, home.netns} <= set(os.listdir("/var/run/netns"))
    assert sleeper.poll() is not None, "the lab's process outlived it"
    left = [ns for ns in os.listdir("/var/run/netns") if ns.startswith(lab.prefix + "-")]
    assert not left, "the lab left namespaces behind"


@needs_lab
def test_leftovers_of_a_dead_lab_are_removed() -> None:
    # pid 2**22 + 1 is above Linux's largest pid, so no live process owns this name.
    stale = f"{PREFIX}-{2**22 + 1}-1-srv"
    run("ip", "netns", "add", stale)
    assert stale in remove_leftovers()
    assert stale not in os.listdir("/var/run/netns")
