"""``sparseloco bench speed``: the node's training speed round by round, beside ``simulate``'s.

Runs ``sparseloco up`` (SeaweedFS, a coordinator and N node processes on loopback; a prepared
dataset is streamed from the store, as in a real run) and reads every node's ``event=trained``
lines: the round's tokens/s, and the median wall and process-CPU seconds of one inner step with
torch's thread count (``node.compute.throughput``). Then ``simulate`` (SparseLoCo on the same
model, H, batch, data and torch threads) runs in this process, each round's inner steps timed
the same way (its workers train one after another, so its tokens/s is one process's, like a
node's). Both should be flat from round 0 on.

A node started by hand has numba's default pool, one thread per core, while ``up`` gives its
nodes ``NUMBA_NUM_THREADS`` = ``--threads``; the bench gives them ``--numba-threads`` (default:
every core), the case in which nodes trained 4-6x slower after round 0 until
``protocol.kernels.parallel`` kept torch's thread count. Without ``--data`` the bundled corpus
is prepared first, as README's LLaMA example does (a BPE of 4,096 ids, 16,384-token shards).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import numba
import torch

from node.cluster.up import UpConfig, up
from node.compute.data import CORPUS_DIR
from node.research.report import publish
from node.research.simulate import (
    Merge,
    Replica,
    SimConfig,
    Simulation,
    build_config,
    run_sparseloco,
)
from node.tools.shards import prepare
from protocol import kernels

#: ``key=value`` fields of a node's log line.
_FIELD = re.compile(r"(\w+)=(\S+)")


def trained_lines(log: Path) -> list[dict[str, str]]:
    """The fields of every ``event=trained`` line of a node's log, in order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if "event=trained " in line:
            out.append(dict(_FIELD.findall(line)))
    return out


def node_rounds(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Per node (``logs/node-*.log``), each trained round: tokens/s, median step wall and CPU
    seconds, torch threads."""
    nodes = {}
    for log in sorted((run_dir / "logs").glob("node-*.log")):
        rows = []
        for f in trained_lines(log):
            rows.append(
                {
                    "round": int(f["round"]),
                    "tokens_per_s": float(f["tokens_per_s"]),
                    "step_s": _number(f.get("step_s")),
                    "step_cpu_s": _number(f.get("step_cpu_s")),
                    "threads": int(f["threads"]) if f.get("threads", "-") != "-" else None,
                }
            )
        nodes[log.stem] = rows
    return nodes


def _number(text: str | None) -> float | None:
    return None if text in (None, "-") else float(text)


class _TimedSimulation(Simulation):
    """``Simulation`` with each round's inner steps timed (wall, process CPU, torch threads)."""

    def __init__(self, cfg: SimConfig) -> None:
        super().__init__(cfg)
        self.rounds_timed: list[dict[str, Any]] = []

    def train_workers(
        self, workers: list[Replica], round_: int, merge: Merge | None = None
    ) -> float:
        steps = len(workers) * self.cfg.inner_steps
        threads = torch.get_num_threads()
        wall, cpu = time.perf_counter(), time.process_time()
        loss = super().train_workers(workers, round_, merge)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        tokens = steps * self.cfg.batch_size * self.model_cfg.ctx_len
        self.rounds_timed.append(
            {
                "round": round_,
                "tokens_per_s": tokens / wall,
                "step_s": wall / steps,
                "step_cpu_s": cpu / steps,
                "threads": threads,
            }
        )
        return loss


def simulate_rounds(
    preset: str, data: str, *, workers: int, rounds: int, threads: int, numba_threads: int
) -> list[dict[str, Any]]:
    """``simulate`` of SparseLoCo with the nodes' shape, data and threads; each round's timing."""
    cfg = build_config(preset, algo="sparseloco", workers=workers, rounds=rounds, data=data)
    saved = torch.get_num_threads(), kernels.pool_threads()
    numba.set_num_threads(min(numba_threads, int(numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(cfg.seed)
        sim = _TimedSimulation(cfg)
        run_sparseloco(sim)
        return sim.rounds_timed
    finally:
        numba.set_num_threads(saved[1])
        torch.set_num_threads(saved[0])


def slowdown(rows: list[dict[str, Any]], key: str) -> float | None:
    """The slowest later round's median step ``key`` over round 0's (1.0: flat)."""
    first = [r[key] for r in rows if r["round"] == 0 and r[key]]
    later = [r[key] for r in rows if r["round"] > 0 and r[key]]
    return max(later) / first[0] if first and later else None


def markdown(nodes: dict[str, list[dict[str, Any]]], sim: list[dict[str, Any]]) -> str:
    names = sorted(nodes)
    head = ["round"]
    for n in names:
        head += [f"{n} tokens/s", f"{n} step CPU s", f"{n} threads"]
    head += ["simulate tokens/s", "simulate step CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    by_round = {n: {r["round"]: r for r in nodes[n]} for n in names}
    sim_by = {r["round"]: r for r in sim}
    rounds = sorted({r for n in names for r in by_round[n]} | set(sim_by))
    for k in rounds:
        cells = [str(k)]
        for n in names:
            r = by_round[n].get(k)
            cells += (
                [f"{r['tokens_per_s']:,.0f}", _cell(r["step_cpu_s"]), str(r["threads"] or "-")]
                if r
                else ["-"] * 3
            )
        s = sim_by.get(k)
        cells += [f"{s['tokens_per_s']:,.0f}", f"{s['step_cpu_s']:.3f}"] if s else ["-"] * 2
        lines.append("| " + " | ".join(cells) + " |")
    for label, rows in [*((n, nodes[n]) for n in names), ("simulate", sim)]:
        wall, cpu = slowdown(rows, "step_s"), slowdown(rows, "step_cpu_s")
        lines.append(
            f"{label}: slowest later round over round 0: step wall x{_cell(wall, 2)},"
            f" step CPU x{_cell(cpu, 2)}"
        )
    return "\n".join(lines)


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run(
    json_out: str | None,
    *,
    preset: str,
    data: str | None,
    nodes: int,
    rounds: int,
    threads: int,
    numba_threads: int | None,
    run_dir: str | None,
) -> dict[str, Any]:
    folder = Path(run_dir) if run_dir else Path("runs") / time.strftime("speed-%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    if data is None:
        data = str(folder / "data")
        corpus = sorted(str(p) for p in CORPUS_DIR.glob("*.txt"))
        prepare(corpus, Path(data), train_vocab=4096, shard_tokens=16384)
    pool = numba_threads or os.cpu_count() or 1
    cfg = UpConfig(
        nodes=nodes,
        rounds=rounds,
        preset=preset,
        run_dir=folder / "up",
        data=data,
        round_timeout_s=600.0,
        threads=threads,
    )
    result = up(cfg, node_env={"NUMBA_NUM_THREADS": str(pool)})
    per_node = node_rounds(folder / "up")
    sim = simulate_rounds(
        preset, data, workers=nodes, rounds=rounds, threads=threads, numba_threads=pool
    )
    report = {
        "preset": preset,
        "nodes": nodes,
        "rounds": rounds,
        "threads": threads,
        "numba_threads": pool,
        "node_rounds": per_node,
        "simulate_rounds": sim,
        "up_wall_seconds": result["wall_seconds"],
        "slowdown": {
            label: {"step_s": slowdown(rows, "step_s"), "step_cpu_s": slowdown(rows, "step_cpu_s")}
            for label, rows in [*per_node.items(), ("simulate", sim)]
        },
    }
    publish(markdown(per_node, sim), report, json_out)
    return report
