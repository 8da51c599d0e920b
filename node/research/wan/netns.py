"""Network namespaces for the WAN lab: make, enter, shape, clean up.

The primitives under ``node.research.wan.lab``: ``run`` an ``ip``/``tc`` command with its error
as a ``LabError``; ``netns`` puts the calling thread into a namespace for a block (``setns``,
then back), which is how sockets and child processes are created inside one; ``tbf_args`` is
the token bucket of a rate; every lab's namespaces are named ``slwan-<pid>-<n>-*``, so
``remove_leftovers`` can delete those of labs whose process died without cleaning up, and
``probe`` tells whether this machine can build a lab at all.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

#: Every lab's namespaces start with this, then the owning pid.
PREFIX = "slwan"
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = Path("/var/run/netns")


class LabError(RuntimeError):
    """A namespace, link or relay of the lab could not be set up."""


def run(*argv: str) -> str:
    """Run ``argv`` (``ip``, ``tc``); its output, or a ``LabError`` with its message."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def tbf_args(mbit: float) -> list[str]:
    """``tc`` arguments of a token bucket at ``mbit``: a bucket of 10 ms of traffic (at least
    64 KiB, so a veth's GSO bursts fit) and a queue of at most 50 ms (a modest bufferbloat)."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes / 100))
    return ["tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "latency", "50ms"]


@contextlib.contextmanager
def netns(name: str) -> Iterator[None]:
    """Run the calling thread in network namespace ``name`` for the block (then back).

    Sockets created and processes started in the block belong to ``name``; the rest of the
    process is unaffected (a network namespace is per thread until exec)."""
    libc = ctypes.CDLL(None, use_errno=True)
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    there = os.open(_NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(there, _CLONE_NEWNET) != 0:
            raise LabError(f"setns({name}): {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            if libc.setns(here, _CLONE_NEWNET) != 0:  # pragma: no cover - cannot fail as root
                raise LabError(f"setns back: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(here)
        os.close(there)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _lab_namespaces() -> list[str]:
    try:
        return sorted(p.name for p in _NETNS_DIR.iterdir() if p.name.startswith(PREFIX + "-"))
    except OSError:
        return []


def delete_namespace(name: str) -> None:
    """Kill what still runs in ``name`` (only a lab's own processes run there), delete it."""
    done = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    for pid in done.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def remove_leftovers() -> list[str]:
    """Delete the namespaces of labs whose process is gone (a crash, a kill -9)."""
    removed = []
    for name in _lab_namespaces():
        match = re.match(rf"{PREFIX}-(\d+)-", name)
        if match and not _pid_alive(int(match.group(1))):
            delete_namespace(name)
            removed.append(name)
    return removed


@functools.cache
def probe() -> str | None:
    """Why a lab cannot be built here, or None: root, the tools, a namespace with a tbf."""
    if sys.platform != "linux":
        return f"network namespaces are Linux-only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and tc); CI runs as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not on PATH"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    try:
        run("ip", "netns", "add", probe)
        run("ip", "-n", probe, "link", "add", "dev", "va", "type", "veth", "peer", "name", "vb")
        run("tc", "-n", probe, "qdisc", "add", "dev", "va", "root", *tbf_args(10))
        with netns(probe):
            pass
    except (LabError, OSError) as exc:
        return f"cannot build a namespace with a shaped veth: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None
