"""What a chaos scenario injected, how its nodes recovered, and the results files.

Pure functions of the scenario and the coordinator's final status, apart from the writer: the
fault list (every step and armed ``SPARSELOCO_FAULTS`` entry, by round), per faulted node the
first later round it is in a gather set again (checked: within ``recover_within`` rounds), the
comparison with the fault-free baseline's loss (check (e)), and ``write_results`` for the JSON
and its Markdown table. ``runner`` drives the processes and calls these at the end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from protocol.messages import StatusView

from .invariants import Failure, closed
from .scenario import Scenario, fault_entries
from .table import render_markdown

#: Steps that undo a fault rather than inject one.
RECOVERIES = frozenset({"restart_node", "restart_coordinator"})


def fault_list(sc: Scenario) -> list[dict[str, Any]]:
    """Every fault injected (restarts are recoveries, listed under ``events`` only)."""
    out: list[dict[str, Any]] = [
        {"round": s.round, "when": s.when, "action": s.action, "target": s.target}
        for s in sc.steps
        if s.action not in RECOVERIES
    ]
    armed: list[tuple[str, str]] = list(sc.faults.items())
    armed += [(s.target, s.faults) for s in sc.steps if s.faults and s.target]
    for node, text in armed:
        for action, r in fault_entries(text):
            out.append({"round": r, "when": "in", "action": action, "target": node})
    return sorted(out, key=lambda f: (f["round"], f["action"]))


def recovery(sc: Scenario, s: StatusView) -> list[dict[str, Any]]:
    """Per fault that takes a node out of a round: the first later round it is gathered again."""
    done = closed(s)
    out = []
    for fault in fault_list(sc):
        node, r = fault["target"], fault["round"]
        if not node:
            continue  # the coordinator or the store: no node to see back
        back = next((x.round for x in done if x.round > r and node in x.gather), None)
        out.append(
            {
                "node": node,
                "fault": fault["action"],
                "round": r,
                "back_in_gather": back,
                "rounds_to_recover": None if back is None else back - r,
            }
        )
    return out


def check_recovery(sc: Scenario, s: StatusView) -> list[Failure]:
    """A failure for each faulted node not gathered again within ``sc.recover_within`` rounds."""
    last = max((r.round for r in closed(s)), default=-1)
    out = []
    for rec in recovery(sc, s):
        if rec["fault"] == "start_node":
            continue  # a joiner's first rounds go to starting up and catching up
        if rec["back_in_gather"] is None and rec["round"] + sc.recover_within < last:
            out.append(
                Failure(
                    "recovery",
                    rec["round"],
                    f"{rec['node']} ({rec['fault']}) never back in a gather set",
                )
            )
        elif rec["rounds_to_recover"] and rec["rounds_to_recover"] > sc.recover_within:
            out.append(
                Failure(
                    "recovery",
                    rec["round"],
                    f"{rec['node']} ({rec['fault']}) took {rec['rounds_to_recover']}"
                    f" rounds to be gathered again (> {sc.recover_within})",
                )
            )
    return out


def compare_to_baseline(result: dict[str, Any], baseline: dict[str, Any], tol: float) -> None:
    """Add the baseline's loss to ``result`` and (e) a failure when they differ by over ``tol``."""
    mine, base = result["final_eval_loss"], baseline["final_eval_loss"]
    result["baseline_eval_loss"] = base
    result["baseline_wall_s"] = baseline["wall_s"]
    result["baseline_failures"] = baseline["failures"]
    if mine is None or base is None:
        result["loss_rel_diff"] = None
        result["failures"].append("[e] run: no final eval loss to compare")
        return
    rel = abs(mine - base) / abs(base)
    result["loss_rel_diff"] = rel
    if rel > tol:
        result["failures"].append(
            f"[e] run: final eval loss {mine:.4f} vs fault-free {base:.4f} ({rel:.1%} > {tol:.0%})"
        )


def write_results(result: dict[str, Any], tmp_path: Path) -> Path:
    """The result as JSON in ``tmp_path`` and, with ``CHAOS_RESULTS`` set, there too."""
    text = json.dumps(result, indent=2, sort_keys=True, default=str)
    path = tmp_path / f"{result['scenario']}.json"
    path.write_text(text)
    target = os.environ.get("CHAOS_RESULTS")
    if target:
        out = Path(target)
        if out.suffix != ".json":
            out.mkdir(parents=True, exist_ok=True)
            out = out / path.name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    (tmp_path / f"{result['scenario']}.md").write_text(render_markdown([result]))
    return path
