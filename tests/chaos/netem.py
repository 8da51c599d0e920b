"""Can this machine inject network faults? Network namespaces, a veth pair, and ``tc netem``.

``netem_unavailable()`` tries exactly what a packet-loss scenario needs (a namespace, a veth
pair into it, a netem qdisc on it), cleans up, and returns ``None`` or the reason it failed,
so the scenario skips cleanly where the kernel or the container does not allow it (here:
``sch_netem`` is not available, "Specified qdisc kind is unknown").
"""

from __future__ import annotations

import os
import shutil
import subprocess


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")


def netem_unavailable() -> str | None:
    """``None`` if namespaces, veth pairs and netem all work here, else the reason."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found"
    ns, host_if, ns_if = f"slprobe{os.getpid()}", f"slph{os.getpid() % 100000}", "slpn0"
    made = False
    try:
        _run(["ip", "netns", "add", ns])
        made = True
        _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if])
        _run(["ip", "link", "set", ns_if, "netns", ns])
        _run(["tc", "qdisc", "add", "dev", host_if, "root", "netem", "delay", "1ms"])
    except RuntimeError as exc:
        return str(exc)
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, check=False)
        if made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    return None
