"""The WAN lab: every node behind its own shaped, delayed, flaky link, on this one machine.

Layout (Linux network namespaces, all named ``slwan-<pid>-<n>-*`` so a lab owns its names):

    server ns                 bridge ns              node ns (one per node)
    lo: 10.77.0.1 (service)   br0 ─┬─ s0 ── eth0     eth0 10.77.1.(10+i)  tbf = upload rate
    eth0: 10.77.1.1  ─────────────┘  ├─ n0 ── ...    lo: 10.77.0.1 ← the node's relay listens
                                    (tbf on nK = download rate of node K)

The store and the coordinator run in the server namespace and listen on every address there
(``0.0.0.0``); everyone names them by the **service address** 10.77.0.1, which is also what the
coordinator puts in presigned URLs. In a node's namespace the service address sits on ``lo``,
where the node's relay (``node.research.wan.relay``) listens on the store's and the
coordinator's ports and forwards to the server's bridge-side address 10.77.1.1. A node process
therefore uses the very URLs every other process uses (SigV4 signs the Host header, which the
relay passes on unchanged), and its traffic crosses: relay (delay, jitter, window, resets) →
its veth (``tc tbf``: the upload rate) → the bridge → the server; back through the bridge
side's ``tbf`` (the download rate) and the relay again.

Processes join a namespace by ``setns`` on the calling thread around ``fork``
(``WanHost.entered``, ``WanLab.entered``): what they start inherits it, so
``with host.entered(): start_node(...)`` runs the product's own launchers unchanged, and the
test's own status polls run the same way in the server namespace. ``server_run`` and
``WanHost.popen`` start a command in its own process group; ``close()`` stops those, kills
whatever else still runs in the lab's namespaces, and deletes the namespaces (and with them
every veth, the bridge and the qdiscs). A lab that crashed leaves namespaces whose pid no
longer lives: the next lab removes them at start.

Needs root (``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``), ``ip`` and ``tc`` with ``tbf``:
``WanLab.available()`` says why not where they are missing, for tests to skip with.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.research.wan.netns import (
    PREFIX,
    LabError,
    delete_namespace,
    netns,
    probe,
    remove_leftovers,
    run,
    tbf_args,
)
from node.research.wan.profiles import LinkProfile

#: Where the store and the coordinator are reached from everywhere.
SERVICE_IP = "10.77.0.1"
#: The server's address on the bridge, where the relays forward to.
SERVER_LINK_IP = "10.77.1.1"
#: Seconds a relay may take to bind its listeners.
RELAY_START_S = 30.0
#: Seconds a lab's processes get to exit after SIGTERM before SIGKILL.
STOP_GRACE_S = 10.0
_counter = 0


@dataclass
class WanHost:
    """One node's namespace, link and relay."""

    lab: WanLab
    name: str
    profile: LinkProfile
    netns: str
    address: str
    relay: subprocess.Popen[bytes] | None = None
    relay_log: Path | None = None

    def entered(self) -> contextlib.AbstractContextManager[None]:
        """The calling thread in this host's namespace for the block (see ``netns``)."""
        return netns(self.netns)

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in this host's namespace, in its own process group (lab-owned)."""
        return self.lab._popen(self.netns, argv, **kw)


@dataclass
class WanLab:
    """The namespaces, the bridge, the links and every process started in them."""

    root: Path
    service_ip: str = SERVICE_IP
    ports: list[int] = field(default_factory=list)
    hosts: dict[str, WanHost] = field(default_factory=dict)
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        global _counter
        _counter += 1
        self.prefix = f"{PREFIX}-{os.getpid()}-{_counter}"
        self.server = f"{self.prefix}-srv"
        self.bridge = f"{self.prefix}-br"
        self._made: list[str] = []

    @staticmethod
    def available() -> str | None:
        """None where a lab can be built here, else why not (for ``pytest.skip``)."""
        return probe()

    def open(self) -> WanLab:
        reason = self.available()
        if reason is not None:
            raise LabError(f"the WAN lab cannot run here: {reason}")
        remove_leftovers()
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            for ns in (self.bridge, self.server):
                run("ip", "netns", "add", ns)
                self._made.append(ns)
                run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            run("ip", "-n", self.bridge, "link", "set", "br0", "up")
            self._link("s0", self.server, SERVER_LINK_IP)
            run("ip", "-n", self.server, "addr", "add", f"{self.service_ip}/32", "dev", "lo")
        except BaseException:
            self.close()
            raise
        return self

    def _link(self, bridge_end: str, ns: str, address: str) -> None:
        """A veth from the bridge to ``ns`` (``eth0`` there, at ``address``/24)."""
        b = self.bridge
        veth = ["type", "veth", "peer", "name", "eth0", "netns", ns]
        run("ip", "-n", b, "link", "add", "dev", bridge_end, *veth)
        run("ip", "-n", b, "link", "set", bridge_end, "master", "br0", "up")
        run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")

    def expose(self, *ports: int) -> None:
        """Ports of the server namespace that nodes added later reach through their relay."""
        self.ports.extend(p for p in ports if p not in self.ports)

    def entered(self) -> contextlib.AbstractContextManager[None]:
        """The calling thread in the server namespace for the block (see ``netns``)."""
        return netns(self.server)

    def server_run(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in the server namespace, in its own process group (lab-owned)."""
        return self._popen(self.server, argv, **kw)

    def add_node(
        self, name: str, profile: LinkProfile, ports: Sequence[int] | None = None, seed: int = 0
    ) -> WanHost:
        """A node namespace behind ``profile``, its relay forwarding ``ports`` (default: the
        exposed ones) on the service address to the server."""
        ports = list(self.ports if ports is None else ports)
        if not ports:
            raise LabError("no ports to relay: call lab.expose(store_port, coordinator_port)")
        i = len(self.hosts)
        host = WanHost(self, name, profile, f"{self.prefix}-n{i}", f"10.77.1.{10 + i}")
        run("ip", "netns", "add", host.netns)
        self._made.append(host.netns)
        self.hosts[name] = host
        run("ip", "-n", host.netns, "link", "set", "lo", "up")
        run("ip", "-n", host.netns, "addr", "add", f"{self.service_ip}/32", "dev", "lo")
        self._link(f"n{i}", host.netns, host.address)
        tc = ("tc", "-n")
        run(*tc, host.netns, "qdisc", "add", "dev", "eth0", "root", *tbf_args(profile.up_mbit))
        run(*tc, self.bridge, "qdisc", "add", "dev", f"n{i}", "root", *tbf_args(profile.down_mbit))
        self._start_relay(host, ports, seed)
        return host

    def _start_relay(self, host: WanHost, ports: list[int], seed: int) -> None:
        p = host.profile
        argv = [sys.executable, "-m", "node.research.wan.relay", "--seed", str(seed)]
        argv += ["--rtt-ms", f"{p.rtt_ms:g}", "--jitter-ms", f"{p.jitter_ms:g}", "--listen"]
        argv += [f"{self.service_ip}:{port}={SERVER_LINK_IP}:{port}" for port in ports]
        if p.reset_every_s is not None:
            argv += ["--reset-every-s", f"{p.reset_every_s:g}"]
        host.relay_log = self.root / f"relay-{host.name}.log"
        with open(host.relay_log, "wb") as out:  # a new lab in the same folder starts afresh
            host.relay = host.popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + RELAY_START_S
        while b"event=relay_ready" not in host.relay_log.read_bytes():
            if host.relay.poll() is not None or time.monotonic() > deadline:
                tail = host.relay_log.read_text(errors="replace")[-2000:]
                raise LabError(f"the relay of {host.name} did not start:\n{tail}")
            time.sleep(0.05)

    def resets(self, name: str) -> int:
        """How many connections node ``name``'s relay has reset so far."""
        log = self.hosts[name].relay_log
        return (
            0 if log is None else log.read_text(errors="replace").count("event=relay_reset conn=")
        )

    def _popen(self, ns: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        kw.setdefault("stdin", subprocess.DEVNULL)
        with netns(ns):
            proc = subprocess.Popen(list(argv), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        """Stop the lab's processes (SIGTERM, then SIGKILL), delete its namespaces."""
        live = [p for p in self.procs if p.poll() is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for ns in reversed(self._made):
            delete_namespace(ns)
        self._made.clear()

    def __enter__(self) -> WanLab:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
