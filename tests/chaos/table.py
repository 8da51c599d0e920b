"""Render chaos results (``runner.write_results`` JSON) as Markdown tables for the README.

    python -m tests.chaos.table results.json [more.json ...]

One summary row per scenario (faults, rounds survived, fingerprint agreement, final loss
against the fault-free run, invariant failures), then per scenario its faults with the round
each was injected in and how many rounds the node took to be back in a gather set. Standard
library only, so it runs without the project's environment.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def render_markdown(results: list[dict[str, Any]]) -> str:
    lines = [
        "| scenario | nodes | faults injected | rounds survived | fingerprints agree"
        " | final eval loss | fault-free | Δ | invariant failures |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        agree = r.get("agreement", [])
        ok = sum(1 for a in agree if a["ok"])
        excused = sum(len(a["excused"]) for a in agree)
        rel = r.get("loss_rel_diff")
        lines.append(
            f"| {r['scenario']} | {r['nodes']} | {len(r['faults'])}"
            f" | {r['rounds_closed']}/{r['rounds']} | {ok}/{len(agree)}"
            + (f" ({excused} diverged, excluded)" if excused else "")
            + f" | {_loss(r.get('final_eval_loss'))} | {_loss(r.get('baseline_eval_loss'))}"
            f" | {'-' if rel is None else f'{rel:+.1%}'.replace('+', '')}"
            f" | {len(r.get('failures', []))} |"
        )
    for r in results:
        lines += [
            "",
            f"**{r['scenario']}**: faults and recovery (wall {r.get('wall_s', '-')} s,"
            f" fault-free {r.get('baseline_wall_s', '-')} s)",
            "",
            "| round | fault | node | back in a gather set | rounds to recover |",
            "|---|---|---|---|---|",
        ]
        recovery = {(x["node"], x["round"]): x for x in r.get("recovery", [])}
        for f in r["faults"]:
            rec = recovery.get((f["target"], f["round"]), {})
            back = rec.get("back_in_gather")
            lines.append(
                f"| {f['round']} | {f['action']} | {f['target'] or '-'}"
                f" | {_dash(back)}"
                f" | {_dash(rec.get('rounds_to_recover'))} |"
            )
        for failure in r.get("failures", []):
            lines.append(f"- {failure.splitlines()[0]}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m tests.chaos.table results.json [more.json ...]", file=sys.stderr)
        return 2
    results = [json.loads(Path(p).read_text()) for p in argv]
    print(render_markdown(results), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
