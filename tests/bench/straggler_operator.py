"""One node slowed by SIGSTOP / SIGCONT, through the operator's path (run by hand):

    python tests/bench/straggler_operator.py --budget off    --dir bench-out/stop-off
    python tests/bench/straggler_operator.py --budget median --dir bench-out/stop-median

Issue 33's own experiment, command for command as the README's operator path has it:
``sparseloco store``, ``sparseloco coordinator --config run.toml`` (``deploy/run.example.toml``
with the ``small`` model, ``--inner-steps`` H, ``--rounds``, four members and the ``--budget``
under test), ``sparseloco coordinator token add`` and four ``sparseloco node --threads 1``.
From round ``--slow-from`` node-3's process is stopped and continued in a duty cycle: it runs
1/F of every ``PERIOD_S`` (``--factor`` F), so everything it does (steps, encode, upload) is F
times slower, as on a slower machine. (``sparseloco bench straggler`` slows only the inner
steps, through the fault hook, and so depends less on the machine's load.)

Printed at the end, from ``GET /v1/status``: per node the share of the wall time it trained
(Σ its training seconds over Σ the rounds' durations) over the equal rounds (1 to F-1) and over
the slowed ones (from ``--slow-from`` + 1, the last round left out), what the others kept, the
slow node's steps, and whether every round's fingerprints agreed (docs/benchmarks.md §19).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from node.research.bench.straggler import status_shares
from protocol.messages import RoundState
from protocol.status import StatusView

ROOT = Path(__file__).resolve().parents[2]
PERIOD_S = 0.3
STORE_PORT, COORD_PORT = 18333, 18700
SLOW = "node-3"


def config(text: str, values: dict[str, str]) -> str:
    """The example config with ``values`` set (each key's first assignment, comment kept)."""
    for key, value in values.items():
        text, n = re.subn(rf"(?m)^{key} = [^#\n]*?(\s*#|$)", f"{key} = {value}\\1", text, count=1)
        if n != 1:
            raise SystemExit(f"deploy/run.example.toml has no line '{key} = ...'")
    return text


class Run:
    """The processes of one run, each in a session of its own, stopped in reverse order."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": "operator",
            "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
        }
        self.coord_env = {
            **self.env,
            "SPARSELOCO_COORD_STORAGE__ACCESS_KEY": self.env["AWS_ACCESS_KEY_ID"],
            "SPARSELOCO_COORD_STORAGE__SECRET_KEY": self.env["AWS_SECRET_ACCESS_KEY"],
        }

    def start(self, log: str, *args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = open(self.root / f"{log}.out", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            ["sparseloco", *args], cwd=self.root, env=env, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def wait_for(path: Path, pattern: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists() and re.search(pattern, path.read_text(errors="replace")):
            return
        time.sleep(0.3)
    raise SystemExit(f"no {pattern!r} in {path} after {timeout_s:.0f} s")


def status() -> dict[str, Any]:
    url = f"http://127.0.0.1:{COORD_PORT}/v1/status?rounds=200"
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def duty_cycle(proc: subprocess.Popen[bytes], factor: float, stop: threading.Event) -> None:
    """Let ``proc`` run 1/factor of every ``PERIOD_S`` until ``stop`` or its exit."""
    running = PERIOD_S / factor
    while not stop.is_set() and proc.poll() is None:
        try:
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(PERIOD_S - running)
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            return
        time.sleep(running)


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.dir).resolve()
    root.mkdir(parents=True, exist_ok=False)
    r = Run(root)
    stop = threading.Event()
    try:
        r.start("store", "store", "--dir", "store-data", "--port", str(STORE_PORT), env=r.env)
        wait_for(root / "store.out", "store ready")
        named = args.budget in ("off", "median", "fastest")
        budget = f'"{args.budget}"' if named else str(float(args.budget))
        values = {
            "name": '"stop"', "model": '"small"', "rounds": str(args.rounds),
            "inner_steps": str(args.inner_steps), "eval_every": "1000", "checkpoint_every": "0",
            "min_nodes": "4", "first_round_s": "600.0", "budget": budget,
            "port": str(COORD_PORT), "endpoint_url": f'"http://127.0.0.1:{STORE_PORT}"',
        }  # fmt: skip
        example = (ROOT / "deploy" / "run.example.toml").read_text()
        (root / "run.toml").write_text(config(example, values))
        r.start("coordinator", "coordinator", "--config", "run.toml", env=r.coord_env)
        wait_for(root / "coordinator-state" / "coordinator.json", str(COORD_PORT))
        nodes = {}
        for i in range(4):
            name = f"node-{i}"
            token = subprocess.run(
                ["sparseloco", "coordinator", "token", "add", name, "--config", "run.toml"],
                cwd=root, env=r.coord_env, capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            env = {
                **r.env,
                "SPARSELOCO_NODE_TOKEN": token,
                "SPARSELOCO_NODE_COORDINATOR": f"http://127.0.0.1:{COORD_PORT}",
            }
            node_args = ("node", "--state-dir", f"nodes/{name}", "--threads", "1")
            nodes[name] = r.start(name, *node_args, env=env)
        slowing: threading.Thread | None = None
        while True:
            view = status()
            closed = [x for x in view["rounds"] if x["state"] in ("closed", "finished")]
            if slowing is None and any(x["round"] >= args.slow_from - 1 for x in closed):
                slowing = threading.Thread(
                    target=duty_cycle, args=(nodes[SLOW], args.factor, stop), daemon=True
                )
                slowing.start()
                print(f"{time.strftime('%X')} {SLOW} slowed {args.factor:g}x", flush=True)
            if view["state"] == "finished" or all(p.poll() is not None for p in nodes.values()):
                break
            time.sleep(1.0)
        stop.set()
        time.sleep(3.0)  # the last round's reports
        view = status()
        (root / "status.json").write_text(json.dumps(view, indent=1))
        return view
    finally:
        stop.set()
        r.stop()


def summary(view: dict[str, Any], slow_from: int) -> dict[str, Any]:
    status = StatusView.model_validate(view)
    rounds = [r for r in status.rounds if r.state in (RoundState.CLOSED, RoundState.FINISHED)]
    last = max(r.round for r in rounds)
    equal = status_shares(status, range(1, slow_from))
    slowed = status_shares(status, range(slow_from + 1, last))
    reported = [r for r in rounds if r.fingerprints]
    return {
        "share_equal": equal,
        "share_slowed": slowed,
        "kept": {n: slowed.get(n, 0.0) / equal[n] for n in equal if n != SLOW},
        "slow_in_gather": sum(SLOW in r.gather for r in rounds if r.round >= 1),
        "rounds": len([r for r in rounds if r.round >= 1]),
        "slow_steps": [r.work[SLOW].steps if SLOW in r.work else None for r in rounds],
        "fingerprints_agree": all(len(set(r.fingerprints.values())) == 1 for r in reported),
        "duration_s": [r.duration_s for r in rounds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="median", help="off, median, fastest or seconds")
    parser.add_argument("--dir", required=True, help="a new folder for the run")
    parser.add_argument("--factor", type=float, default=3.0, help="node-3 runs 1/F of the time")
    parser.add_argument("--slow-from", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--inner-steps", type=int, default=120)
    args = parser.parse_args()
    result = summary(run(args), args.slow_from)
    print(json.dumps(result, indent=1))
    kept = min(result["kept"].values())
    print(
        f"budget {args.budget}: the others kept {kept:.3f} of their training share (least);"
        f" {SLOW} in {result['slow_in_gather']} of {result['rounds']} gather sets;"
        f" fingerprints {'agree' if result['fingerprints_agree'] else 'DIFFER'}"
    )


if __name__ == "__main__":
    main()
