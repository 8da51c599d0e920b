"""What a lab's link really does: throughput each way, request round trips, resets.

A ``ProbeServer`` listens in the lab's server namespace (a socket made there, served by threads
of the calling process, so nothing else is started); the measuring functions connect from a
node's namespace through its relay and shaped veth, exactly as that node's HTTP requests go.
The tests use them to check that a profile's shape is real, ``sparseloco bench wan`` to report
it beside its runs.

``python -m node.research.wan.measure`` (root) builds a lab with one node per profile and prints
a line per profile: upload and download rate (measured/shaped), the round trip on a
kept-alive connection (median, range) and a first request's on a new one.

The protocol, one request per connection unless echoing: ``U`` + 8-byte length, then that
many bytes, answered by ``K`` once all arrived (an upload); ``D`` + 8-byte length, answered by
that many bytes (a download); ``E``: every byte sent is echoed at once (round trips).
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

from node.research.wan.lab import WanHost, WanLab
from node.research.wan.profiles import PROFILES

#: Seconds any single probe may take before it counts as hung.
PROBE_TIMEOUT_S = 60.0
_BLOCK = 64 * 1024


class ProbeServer:
    """A sink, source and echo server in the lab's server namespace (threads of this process)."""

    def __init__(self, lab: WanLab) -> None:
        with lab.entered():
            self.sock = socket.create_server(("0.0.0.0", 0))
        self.port: int = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True, name="wan-probe")
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            op = conn.recv(1)
            if op == b"E":
                while data := conn.recv(_BLOCK):
                    conn.sendall(data)
                return
            (n,) = struct.unpack("!Q", _exactly(conn, 8))
            if op == b"U":
                while n > 0:
                    data = conn.recv(min(_BLOCK, n))
                    if not data:
                        return
                    n -= len(data)
                conn.sendall(b"K")
            elif op == b"D":
                block = b"\0" * _BLOCK
                while n > 0:
                    conn.sendall(block[: min(_BLOCK, n)])
                    n -= min(_BLOCK, n)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> ProbeServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _exactly(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        data = conn.recv(n - len(out))
        if not data:
            raise ConnectionError("the peer closed early")
        out += data
    return out


def _connect(lab: WanLab, host: WanHost, port: int) -> socket.socket:
    with host.entered():
        return socket.create_connection((lab.service_ip, port), timeout=PROBE_TIMEOUT_S)


def upload_mbit(lab: WanLab, host: WanHost, port: int, nbytes: int) -> float:
    """Mbit/s of one upload of ``nbytes`` on a new connection, from connect to the server's
    acknowledgement of the last byte (handshake and slow start included, as for a payload)."""
    t0 = time.monotonic()
    with _connect(lab, host, port) as conn:
        conn.sendall(b"U" + struct.pack("!Q", nbytes))
        block = b"\0" * _BLOCK
        for start in range(0, nbytes, _BLOCK):
            conn.sendall(block[: min(_BLOCK, nbytes - start)])
        _exactly(conn, 1)
    return nbytes * 8 / 1e6 / (time.monotonic() - t0)


def download_mbit(lab: WanLab, host: WanHost, port: int, nbytes: int) -> float:
    """Mbit/s of one download of ``nbytes`` on a new connection, from connect to the last byte."""
    t0 = time.monotonic()
    with _connect(lab, host, port) as conn:
        conn.sendall(b"D" + struct.pack("!Q", nbytes))
        left = nbytes
        while left > 0:
            data = conn.recv(min(_BLOCK, left))
            if not data:
                raise ConnectionError(f"download ended {left} bytes short")
            left -= len(data)
    return nbytes * 8 / 1e6 / (time.monotonic() - t0)


def round_trips(lab: WanLab, host: WanHost, port: int, n: int) -> tuple[float, list[float]]:
    """Seconds to connect and send a first byte and get it back (a request on a new
    connection), then ``n`` one-byte round trips on that kept-alive connection."""
    t0 = time.monotonic()
    with _connect(lab, host, port) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"E!")
        _exactly(conn, 1)
        first = time.monotonic() - t0
        times = []
        for _ in range(n):
            t = time.monotonic()
            conn.sendall(b"?")
            _exactly(conn, 1)
            times.append(time.monotonic() - t)
    return first, times


def held_until_reset(lab: WanLab, host: WanHost, port: int, limit_s: float) -> float | None:
    """Seconds an idle-but-pinged connection lived before a reset ended it; None if it
    outlived ``limit_s``."""
    t0 = time.monotonic()
    with _connect(lab, host, port) as conn:
        conn.sendall(b"E")
        while time.monotonic() - t0 < limit_s:
            try:
                conn.sendall(b".")
                if not conn.recv(1):
                    return time.monotonic() - t0  # closed rather than reset: count it too
            except (ConnectionResetError, BrokenPipeError):
                return time.monotonic() - t0
            time.sleep(0.05)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node.research.wan.measure")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated names")
    parser.add_argument("--up-mb", type=float, default=4.0, help="MB per upload")
    parser.add_argument("--down-mb", type=float, default=8.0, help="MB per download")
    args = parser.parse_args(argv)
    reason = WanLab.available()
    if reason is not None:
        print(f"the WAN lab cannot run here: {reason}", file=sys.stderr)
        return 2
    up_bytes, down_bytes = int(args.up_mb * 1e6), int(args.down_mb * 1e6)
    with (
        tempfile.TemporaryDirectory() as root,
        WanLab(Path(root)) as lab,
        ProbeServer(lab) as probe,
    ):
        lab.expose(probe.port)
        for name in args.profiles.split(","):
            p = PROFILES[name].with_reset(None)  # a reset would end a probe early
            host = lab.add_node(name, p)
            up = upload_mbit(lab, host, probe.port, up_bytes)
            down = download_mbit(lab, host, probe.port, down_bytes)
            first, kept = round_trips(lab, host, probe.port, 9)
            print(
                f"profile={name} up_mbit={up:.1f}/{p.up_mbit:g}"
                f" down_mbit={down:.1f}/{p.down_mbit:g}"
                f" rtt_ms={statistics.median(kept) * 1e3:.0f}/{p.rtt_ms:g}±{p.jitter_ms:g}"
                f" rtt_range_ms={min(kept) * 1e3:.0f}-{max(kept) * 1e3:.0f}"
                f" first_request_ms={first * 1e3:.0f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
