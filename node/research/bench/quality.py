"""``sparseloco bench quality``: SparseLoCo, DiLoCo and DDP on equal tokens, side by side.

Runs the three algorithms with the same run preset (by default ``bench``: the ~0.44M-parameter
byte-level model, 4 workers, H=30, k=64, on the bundled corpus), writes each result JSON, a
summary JSON, a markdown table and a PNG of the three eval-loss curves into one folder.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from node.research.progress import round_progress
from node.research.report import write_json
from node.research.simulate import build_config, simulate

log = logging.getLogger("sparseloco.bench.quality")


def plot_curves(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Eval loss against tokens per worker for every algorithm, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for algo, res in results.items():
        rounds = res["config"]["rounds"]
        per_round = res["tokens_per_worker"] / rounds
        xs = [r * per_round / 1e6 for r, _ in res["eval_loss_curve"]]
        ys = [loss for _, loss in res["eval_loss_curve"]]
        mb = res["bytes_per_round_per_worker"] / 1e6
        ax.plot(xs, ys, marker=".", label=f"{algo} ({mb:.3g} MB/round/worker)")
    ax.set_xlabel("tokens per worker (millions)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summary_table(results: dict[str, dict[str, Any]]) -> str:
    """README-ready markdown: final loss, bytes per round, compression against DiLoCo."""
    dense = results.get("diloco", {}).get("bytes_per_round_per_worker")
    lines = [
        "| algorithm | final eval loss (nats) | bytes/round/worker | vs DiLoCo bytes | wall (s) |",
        "|---|---|---|---|---|",
    ]
    for algo, res in results.items():
        per_round = res["bytes_per_round_per_worker"]
        ratio = (
            f"{dense / per_round:.0f}x fewer"
            if dense and per_round < dense
            else (f"{per_round / dense:.0f}x more" if dense and per_round > dense else "1x")
        )
        lines.append(
            f"| {algo} | {res['final_eval_loss']:.4f} | {per_round:,.0f} | {ratio} | "
            f"{res['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)


def run_quality(
    out: str | Path,
    *,
    preset: str = "bench",
    algos: list[str] | None = None,
    rounds: int | None = None,
    data: str | None = None,
    **overrides: Any,
) -> dict[str, dict[str, Any]]:
    """Run every algorithm of ``algos`` and write results, table and plot under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for algo in algos or ["sparseloco", "diloco", "ddp"]:
        cfg = build_config(preset, algo=algo, rounds=rounds, data=data, **overrides)
        with round_progress(f"{preset} {algo}", cfg.rounds) as progress:
            results[algo] = simulate(cfg, progress=progress)
        write_json(results[algo], out / f"{algo}.json")
    table = summary_table(results)
    (out / "summary.md").write_text(table + "\n")
    (out / "summary.json").write_text(
        json.dumps(
            {
                a: {
                    k: r[k]
                    for k in (
                        "final_eval_loss",
                        "bytes_per_round_per_worker",
                        "tokens_per_worker",
                        "wall_seconds",
                    )
                }
                for a, r in results.items()
            },
            indent=2,
        )
        + "\n"
    )
    plot_curves(results, out / "eval_loss.png", f"preset {preset}: held-out loss")
    print(table)
    print(f"wrote {out}/ (per-algorithm JSON, summary.md, summary.json, eval_loss.png)")
    return results
