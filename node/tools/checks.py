"""``sparseloco doctor``'s checks of this machine alone: state dir, disk, memory, threads, GPU.

Each is a ``Check`` (name, level, detail, fix). They need no network; what the run's model
needs comes from its preset when the coordinator named one, and without it disk and memory are
still shown, marked as not checked against a need (``SKIPPED``). ``node.tools.doctor`` runs the
checks that talk to the coordinator and the store, and prints them all.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from protocol.causes import cause

#: What a check that could not run says instead of a level.
SKIPPED = "--"
#: fp32 copies of the model a node holds: θ, error buffer, two AdamW moments, θ_r during
#: training, ĉ, gradients, and the state file's atomic copy on disk.
MEMORY_COPIES = 7
DISK_COPIES = 10


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # "ok", "warn", "FAIL", or SKIPPED (an earlier failure left nothing to check)
    detail: str
    fix: str = ""


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def state_check(d: Path, run_id: str | None) -> Check:
    """What the node will make of ``d`` (``--state-dir``) in run ``run_id`` (None: unknown)."""
    if not (d / "state.safetensors").exists():
        return Check(
            "state", "ok", f"{d}: no state yet (the node starts from the run's newest checkpoint)"
        )
    from safetensors import safe_open

    try:
        with safe_open(str(d / "state.safetensors"), framework="pt") as f:
            header = json.loads((f.metadata() or {})["sparseloco"])
    except Exception as exc:  # a damaged file: the node sets it aside
        detail = f"{d}: unreadable state ({cause(exc)}); the node will set it aside"
        return Check("state", "warn", detail)
    if run_id is not None and header.get("run_id") != run_id:
        return Check(
            "state",
            "FAIL",
            f"{d} holds run {header.get('run_id')}, the coordinator runs {run_id}",
            "use another --state-dir for this run",
        )
    return Check("state", "ok", f"{d}: {header.get('node_id')} at round {header.get('round')}")


def machine_checks(model: str | None, state_dir: Path | None) -> list[Check]:
    """Disk, memory, threads and GPU, against what ``model`` (a preset name) needs."""
    checks = []
    need = None
    if model is not None:
        from node.compute.model import get_preset, param_count

        need = 4 * param_count(get_preset(model))
    where = state_dir or Path.cwd()
    probe_dir = where if where.exists() else where.parent
    free = shutil.disk_usage(probe_dir if probe_dir.exists() else Path.cwd()).free
    available = _mem_available()
    unknown = "what the run's model needs is not known without the coordinator"
    if need is None:
        checks.append(Check("disk", SKIPPED, f"{human_bytes(free)} free at {probe_dir}; {unknown}"))
        if available is not None:
            checks.append(
                Check("memory", SKIPPED, f"{human_bytes(available)} available; {unknown}")
            )
    else:
        fix = "free space or point --state-dir at a larger disk"
        checks.append(_room("disk", free, DISK_COPIES * need, f"free at {probe_dir}", fix))
        if available is not None:
            fix = "close other programs or use a larger machine"
            checks.append(_room("memory", available, MEMORY_COPIES * need, "available", fix))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    checks.append(
        Check(
            "threads",
            "ok",
            f"{cores} CPU cores for this process",
            "several nodes on one machine: give each --threads (cores / nodes)",
        )
    )
    import torch

    gpu = torch.cuda.is_available()
    detail = f"CUDA: {torch.cuda.get_device_name(0)}" if gpu else "no CUDA device: trains on CPU"
    checks.append(Check("gpu", "ok", detail))
    return checks


def _level(fine: bool, tolerable: bool) -> str:
    return "ok" if fine else "warn" if tolerable else "FAIL"


def _room(name: str, have: int, need: int, where: str, fix: str) -> Check:
    """Room for the run's model: fine with twice ``need``, tolerable with ``need``."""
    level = _level(have >= 2 * need, have >= need)
    said = f"{human_bytes(have)} {where}; the run's model needs about {human_bytes(need)}"
    return Check(name, level, said, "" if level == "ok" else fix)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
