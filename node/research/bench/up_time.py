"""``sparseloco bench up``: how long ``sparseloco up`` takes as typed, phase by phase, with the
machine's load at the time.

It runs the console script the README gives, ``sparseloco up`` (with only ``--dir`` and
``--json`` added, to keep each run's folder and result), ``--runs`` times one after the other.
The first run finds an empty numba cache (``NUMBA_CACHE_DIR`` set to a new folder, as on a
machine just installed: the codec's kernels compile there, in every node at once); the later
runs reuse that folder, as every run after the first does. Per run:

- the wall time as the user sees it, from the process's start to its exit, and the seconds
  the summary line names (``... with 3 nodes in N s``);
- the phases, from the log lines ``up`` writes to stderr without a terminal: Python and the
  store starting (to ``event=store_started``), the coordinator (to ``event=up_started``), the
  nodes starting and round 0 (to the first ``event=round_closed``), the other rounds, the
  nodes' exit (to ``event=final_model_kept``) and the store's stop with the process's exit;
- the 1-minute load average and the kernel's CPU pressure (``some avg10``) at its start.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from node.research.bench.coordinator_load import cpu_pressure
from node.research.report import publish

#: The phases, each ending at the first log line matching its pattern (None: the exit).
PHASES: tuple[tuple[str, str | None], ...] = (
    ("python and store", r"event=store_started"),
    ("coordinator", r"event=up_started"),
    ("nodes start, round 0", r"event=round_closed round=0 "),
    ("other rounds", r"event=round_closed round=\d+ done=(\d+)/\1 "),
    ("nodes exit", r"event=final_model_kept"),
    ("store stop, exit", None),
)
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _pressure() -> float | None:
    """The kernel's ``some avg10`` CPU pressure (percent of time runnable work waited)."""
    found = re.search(r"avg10=([\d.]+)", cpu_pressure())
    return float(found.group(1)) if found else None


def phases(stderr: str, started: float, ended: float) -> dict[str, float]:
    """Seconds per phase from ``up``'s log lines (``started``, ``ended``: the process's wall
    clock); a phase whose line never came is left out."""
    stamps: list[tuple[float, str]] = []
    for line in stderr.splitlines():
        found = _STAMP.match(line)
        if found:
            when = datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            stamps.append((when, line))
    out: dict[str, float] = {}
    last = started
    for name, pattern in PHASES:
        if pattern is None:
            out[name] = ended - last
            break
        at = next((t for t, line in stamps if re.search(pattern, line)), None)
        if at is None:
            continue
        out[name] = at - last
        last = at
    return out


def one_run(root: Path, i: int, cache: Path) -> dict[str, Any]:
    """``sparseloco up`` once, as typed; what it took."""
    script = Path(sys.executable).with_name("sparseloco")
    run_dir, result_path = root / f"run-{i}", root / f"run-{i}.json"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    cold = not any(cache.rglob("*.nbi"))
    load, pressure = os.getloadavg()[0], _pressure()
    started = time.time()
    done = subprocess.run(
        [str(script), "up", "--dir", str(run_dir), "--json", str(result_path)],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"sparseloco up exited {done.returncode}:\n{done.stderr[-3000:]}")
    summary = re.search(r"with \d+ nodes in ([\d.]+) s", done.stdout)
    result = json.loads(result_path.read_text())
    return {
        "run": i,
        "numba_cache": "cold" if cold else "warm",
        "load_1m_at_start": load,
        "cpu_pressure_avg10_at_start": pressure,
        "wall_s": ended - started,
        "summary_s": float(summary.group(1)) if summary else None,
        "phases_s": phases(done.stderr, started, ended),
        "rounds": len(result["rounds"]),
        "fingerprints_agree": result["fingerprints_agree"],
    }


def table(runs: list[dict[str, Any]]) -> str:
    names = [name for name, _ in PHASES]
    head = ["run", "numba cache", "load", "CPU pressure %", "wall s", "summary s", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        pressure = r["cpu_pressure_avg10_at_start"]
        cells = [
            str(r["run"]),
            r["numba_cache"],
            f"{r['load_1m_at_start']:.1f}",
            "-" if pressure is None else f"{pressure:.0f}",
            f"{r['wall_s']:.1f}",
            "-" if r["summary_s"] is None else f"{r['summary_s']:.1f}",
            *(f"{r['phases_s'][n]:.1f}" if n in r["phases_s"] else "-" for n in names),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(runs: int, run_dir: str | None, json_out: str | None) -> dict[str, Any]:
    """``runs`` runs of ``sparseloco up``; the report."""
    if runs < 1:
        raise ValueError(f"--runs {runs}: give 1 or more")
    root = Path(run_dir or Path("runs") / time.strftime("bench-up-%Y%m%d-%H%M%S"))
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "numba-cache"
    cache.mkdir(exist_ok=True)
    done = []
    for i in range(runs):
        done.append(one_run(root, i, cache))
        print(
            f"run {i}: {done[-1]['wall_s']:.1f} s at a load of {done[-1]['load_1m_at_start']:.1f}",
            flush=True,
        )
    report = {"command": "sparseloco up", "cpus": os.cpu_count(), "runs": done}
    publish(table(done), report, json_out)
    return report
