"""``sparseloco bench straggler``: one node of a local run slows down; what the others lose.

Two runs of ``sparseloco up`` side by side, the same preset and nodes (real SeaweedFS,
coordinator and node processes on loopback): node ``N-1`` trains every inner step ``--factor``
times as slowly from round ``--slow-from`` on (``SPARSELOCO_FAULTS=slowsteps:F@R``: after each
step it sleeps F - 1 times that step's time, a slower GPU), first with the round's time budget
off (``[run.timing] budget = "off"``: every round waits for every node, the behaviour before
the budget existed), then with the budget ``--budget`` (the run's default, ``median``).

Per run and per node, over the equal rounds (1 to R-1, round 0 paying the start-up) and over
the slowed rounds (R+1 to the one before last: round R has the budget of equal rounds):

- the share of the wall time it spent training (Σ its inner steps' seconds over Σ the rounds'
  durations, open to close; rounds follow each other, so the durations add up to the wall
  time), and that share in the slowed rounds over the equal rounds' ("kept");
- the slow node's steps per round, the share of the gather sets it was in, and whether every
  round's fingerprints agreed.

The issue's bar: the other nodes keep at least 0.9 of their equal-speed share, the slow node is
in at least 90 % of the gather sets, fingerprints agree every round.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node.cluster.up import UpConfig, up
from node.research.report import publish
from protocol.status import StatusView

log = logging.getLogger("sparseloco.bench.straggler")


def shares(result: dict[str, Any], rounds: range) -> dict[str, float]:
    """Per node: Σ training seconds over Σ round durations, over ``rounds``."""
    entries = [e for e in result["rounds"] if e["round"] in rounds]
    wall = sum(e["duration_s"] or 0.0 for e in entries)
    trained: dict[str, float] = {}
    for entry in entries:
        for node, timings in entry["timings"].items():
            trained[node] = trained.get(node, 0.0) + timings.get("train", 0.0)
    if wall <= 0:
        raise ValueError(f"no closed rounds with durations in {rounds}")
    return {node: t / wall for node, t in sorted(trained.items())}


def status_shares(status: StatusView, rounds: range) -> dict[str, float]:
    """``shares`` from the coordinator's status (``GET /v1/status``) instead of ``up``'s
    result: per node, Σ its training seconds over Σ the durations of the closed ``rounds``."""
    chosen = [r for r in status.rounds if r.round in rounds and r.duration_s]
    wall = sum(r.duration_s or 0.0 for r in chosen)
    if wall <= 0:
        raise ValueError(f"no closed rounds with durations in {rounds}")
    trained: dict[str, float] = {}
    for r in chosen:
        for node, report in r.reports.items():
            trained[node] = trained.get(node, 0.0) + report.timings.get("train", 0.0)
    return {node: t / wall for node, t in sorted(trained.items())}


def measure(result: dict[str, Any], slow: str, slow_from: int) -> dict[str, Any]:
    """The numbers of one run: shares before and after the slowdown, the slow node's part."""
    last = max(e["round"] for e in result["rounds"])
    equal = range(1, slow_from)
    slowed = range(slow_from + 1, last)
    before, after = shares(result, equal), shares(result, slowed)
    others = [n for n in before if n != slow]
    kept = {n: after.get(n, 0.0) / before[n] for n in others if before[n] > 0}
    closed = [e for e in result["rounds"] if e["round"] >= 1]
    gathered = [e for e in closed if slow in e["gather"]]
    slow_steps = [
        (e["work"].get(slow) or {}).get("steps") for e in result["rounds"] if e["round"] in slowed
    ]
    durations = [e["duration_s"] for e in result["rounds"] if e["round"] in slowed]
    return {
        "share_equal": before,
        "share_slowed": after,
        "kept": kept,
        "kept_min": min(kept.values()) if kept else None,
        "slow_in_gather": len(gathered) / len(closed) if closed else None,
        "slow_steps": slow_steps,
        "round_s_slowed": statistics.median(durations) if durations else None,
        "budget_s": [e.get("budget_s") for e in result["rounds"]],
        "fingerprints_agree": result["fingerprints_agree"],
        "final_eval_loss": result["final_eval_loss"],
    }


def run_straggler(
    *,
    preset: str = "small",
    nodes: int = 4,
    rounds: int = 12,
    inner_steps: int = 60,
    factor: float = 3.0,
    slow_from: int = 4,
    budgets: tuple[str, ...] = ("off", "median"),
    run_dir: Path | None = None,
) -> dict[str, Any]:
    """Both runs (one per budget); their measurements side by side."""
    if slow_from < 2 or rounds < slow_from + 3:
        raise ValueError(
            f"--slow-from {slow_from} and --rounds {rounds}: equal rounds need round 1 to"
            " --slow-from - 1 (>= 1 of them), slowed rounds at least two after it"
        )
    slow = f"node-{nodes - 1}"
    envs: list[dict[str, str]] = [{} for _ in range(nodes)]
    envs[-1] = {"SPARSELOCO_FAULTS": f"slowsteps:{factor:g}@{slow_from}"}
    root = run_dir or Path("runs") / "bench-straggler"
    out: dict[str, Any] = {
        "preset": preset, "nodes": nodes, "rounds": rounds, "inner_steps": inner_steps,
        "factor": factor, "slow_from": slow_from, "slow_node": slow, "runs": {},
    }  # fmt: skip
    for budget in budgets:
        value: str | float = budget if budget in ("off", "median", "fastest") else float(budget)
        cfg = UpConfig(nodes=nodes, rounds=rounds, preset=preset, run_dir=root / f"budget-{budget}")
        log.info("event=straggler_run budget=%s", budget)
        timing = {"budget": value, "first_round_s": 600.0, "heartbeat_timeout_s": 60.0}
        overrides = {"inner_steps": inner_steps, "eval_every": rounds, "timing": timing}
        result = up(cfg, run_overrides=overrides, node_envs=envs)
        out["runs"][budget] = measure(result, slow, slow_from)
    return out


def table(result: dict[str, Any]) -> str:
    """The markdown table of ``run_straggler``'s result."""
    rows = [
        "| budget | others' training share, equal → slowed | kept (min of the others) |"
        " slow node in gather sets | slow node's steps (slowed rounds) | round s (slowed) |"
        " fingerprints |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    slow = result["slow_node"]
    for budget, m in result["runs"].items():
        others = [n for n in m["share_equal"] if n != slow]
        pairs = ", ".join(
            f"{m['share_equal'][n]:.2f} → {m['share_slowed'].get(n, 0.0):.2f}" for n in others
        )
        steps = ", ".join("-" if s is None else str(s) for s in m["slow_steps"])
        rows.append(
            f"| {budget} | {pairs} | {m['kept_min']:.3f} | {100 * m['slow_in_gather']:.0f} % |"
            f" {steps} | {m['round_s_slowed']:.2f} |"
            f" {'agree' if m['fingerprints_agree'] else 'DIFFER'} |"
        )
    return "\n".join(rows)


def run(
    json_out: str | None,
    *,
    preset: str = "small",
    nodes: int = 4,
    rounds: int = 12,
    inner_steps: int = 60,
    factor: float = 3.0,
    slow_from: int = 4,
    budgets: Sequence[str] = ("off", "median"),
    run_dir: str | None = None,
) -> dict[str, Any]:
    """The ``bench straggler`` command: both runs, the table, the ``--json`` report."""
    result = run_straggler(
        preset=preset, nodes=nodes, rounds=rounds, inner_steps=inner_steps, factor=factor,
        slow_from=slow_from, budgets=tuple(budgets), run_dir=Path(run_dir) if run_dir else None,
    )  # fmt: skip
    publish(table(result), result, json_out)
    return result
