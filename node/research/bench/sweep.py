"""``sparseloco bench sweep``: SparseLoCo's held-out loss over a grid of H and k at equal tokens.

The SparseLoCo paper finds that the best density (k kept entries per 4,096-element tile) grows
with H, the inner steps per round. Every point of the grid trains the same model with the same
workers and batch for the same number of inner steps per worker (``--steps``), so H = 5 runs
``steps / 5`` rounds and H = 45 runs ``steps / 45``; only the final loss is evaluated (before the
first round and after the last), on the same held-out data. ``--diloco`` adds DiLoCo at each H as
the dense reference. Writes ``sweep.json`` (every point, the best k per H) and ``summary.md``
(H by k, the best of each row in bold).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_sweep(
    out: str | Path,
    *,
    model: str,
    data: str | None,
    workers: int,
    batch_size: int,
    steps: int,
    hs: list[int],
    topks: list[int],
    diloco: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Every (H, k) point, then the table; returns the ``sweep.json`` document."""
    bad = [h for h in hs if h < 1 or steps % h]
    if bad:
        raise SystemExit(f"--hs {bad}: every H must divide --steps {steps}")
    from node.research.progress import round_progress  # torch: only when a sweep runs
    from node.research.report import write_json
    from node.research.simulate import build_config, simulate

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    points: list[dict[str, Any]] = []
    grid: list[tuple[str, int, int | None]] = [("sparseloco", h, k) for h in hs for k in topks]
    grid += [("diloco", h, None) for h in hs] if diloco else []
    for algo, h, k in grid:
        cfg = build_config(
            None,
            algo=algo,
            model=model,
            data=data,
            workers=workers,
            batch_size=batch_size,
            inner_steps=h,
            rounds=steps // h,
            topk=k,
            seed=seed,
            eval_final_only=True,
        )
        label = f"{algo} H={h}" + (f" k={k}" if k else "")
        with round_progress(f"sweep {label}", cfg.rounds) as progress:
            res = simulate(cfg, progress=progress)
        name = f"{algo}-H{h}" + (f"-k{k}" if k else "")
        write_json(res, out / f"{name}.json")
        points.append(
            {
                "algo": algo,
                "H": h,
                "topk": k,
                "rounds": cfg.rounds,
                "final_eval_loss": res["final_eval_loss"],
                "bytes_per_round_per_worker": res["bytes_per_round_per_worker"],
                "bytes_per_worker": res["bytes_sent_per_worker"],
                "wall_seconds": res["wall_seconds"],
            }
        )
    doc = {
        "model": model,
        "parameters": res["parameters"],
        "data": data,
        "workers": workers,
        "batch_size": batch_size,
        "steps_per_worker": steps,
        "tokens_per_worker": res["tokens_per_worker"],
        "points": points,
        "best_topk": best_topk(points),
    }
    write_json(doc, out / "sweep.json")
    table = summary_table(points, hs, topks)
    (out / "summary.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out}/ (sweep.json, summary.md, one JSON per point)")
    return doc


def best_topk(points: list[dict[str, Any]]) -> dict[str, int]:
    """For each H (as a string, JSON keys), the k with the lowest final held-out loss."""
    best: dict[str, tuple[float, int]] = {}
    for p in points:
        if p["algo"] != "sparseloco":
            continue
        key = str(p["H"])
        if key not in best or p["final_eval_loss"] < best[key][0]:
            best[key] = (p["final_eval_loss"], p["topk"])
    return {h: k for h, (_, k) in best.items()}


def summary_table(points: list[dict[str, Any]], hs: list[int], topks: list[int]) -> str:
    """Markdown: one row per H, final held-out loss for each k (the row's best in bold)."""
    loss = {(p["algo"], p["H"], p["topk"]): p["final_eval_loss"] for p in points}
    dense = any(p["algo"] == "diloco" for p in points)
    best = best_topk(points)
    head = ["H", "rounds"] + [f"k = {k}" for k in topks] + (["DiLoCo"] if dense else [])
    rows = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for h in hs:
        rounds = next(p["rounds"] for p in points if p["H"] == h)
        cells = [str(h), str(rounds)]
        for k in topks:
            v = f"{loss[('sparseloco', h, k)]:.4f}"
            cells.append(f"**{v}**" if best.get(str(h)) == k else v)
        if dense:
            cells.append(f"{loss[('diloco', h, None)]:.4f}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
