"""``sparseloco bench unequal``: unequal workers at equal wall time (docs/benchmarks.md §18).

Participants differ in speed. For each speed mix this runs the simulator's SparseLoCo for the
same wall time (by default the preset's rounds × H step units: what a fleet of speed-1 workers
needs for them) under the four ways a round can treat the slow ones
(``node.research.simulate.plan_round``):

- (a) ``wait``: every worker trains H steps and the round waits for the slowest;
- (b) ``leave_out``: a worker that cannot train H steps within the budget sits the round out;
- (c) ``budget``: every worker trains until H steps or the budget, whichever comes first, and
  the payloads are weighed by the run's default ``work_weight`` (what the project built);
- (d) ``batch``: H steps each, every worker's batch cut to what fits in the budget;

then the ablation of (c): each work rule (``node.compute.work.RULES``) and the budget of the
fastest worker instead of the median one's. A variant whose run would be the same as one before
it (the default rule is (c); "fastest" where its plan is the median's) is not run again but
shares that result. Each run is one ``simulate()`` call in this process; its result goes to
``OUT/<mix>-<variant>.json``, and a run whose file is there already is read instead of run, so
invocations with disjoint ``--variants`` can share the work (two processes side by side) and a
last one, with every file there, only writes the tables: ``unequal.json`` and ``summary.md``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from node.research.report import write_json

#: The main table's columns, in order: variant -> its heading.
MAIN = {
    "wait": "(a) wait",
    "leave_out": "(b) leave out",
    "budget": "(c) budget",
    "batch": "(d) batch",
}
#: The ablation's columns: each work rule under the median budget, then the fastest budget.
ABLATION = {"mean": "mean", "steps": "steps", "per_step": "per_step", "fastest": "fastest"}
#: What each variant sets on top of the preset (``simulate`` options).
VARIANTS: dict[str, dict[str, Any]] = {
    "wait": {"schedule": "wait"},
    "leave_out": {"schedule": "leave_out"},
    "budget": {"schedule": "budget"},
    "batch": {"schedule": "batch"},
    "mean": {"schedule": "budget", "work_weight": "mean"},
    "steps": {"schedule": "budget", "work_weight": "steps"},
    "per_step": {"schedule": "budget", "work_weight": "per_step"},
    "fastest": {"schedule": "budget", "budget": "fastest"},
}
DEFAULT_MIXES = "1,1,1,0.333;1,0.5,0.333,0.2"


def parse_mixes(text: str) -> list[list[float]]:
    """``--mixes``: speed mixes separated by ``;``, each a comma-separated speed per worker."""
    return [
        [float(v) for v in mix.split(",") if v.strip()] for mix in text.split(";") if mix.strip()
    ]


def mix_name(mix: list[float]) -> str:
    return ",".join(f"{v:g}" for v in mix)


def run(
    *,
    preset: str = "bench",
    model: str | None = None,
    data: str | None = None,
    inner_steps: int | None = None,
    batch_size: int | None = None,
    rounds: int | None = None,
    wall: float | None = None,
    mixes: str | None = None,
    variants: list[str] | None = None,
    final_only: bool = False,
    seed: int | None = None,
    out: str | Path = "bench-out/unequal",
) -> dict[str, Any]:
    """Every (mix, variant) run not on disk yet, then the tables; returns ``unequal.json``."""
    from node.research.progress import round_progress  # torch: only when the bench runs
    from node.research.simulate import build_config, simulate

    names = variants or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants {','.join(unknown)}: choose from {','.join(VARIANTS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    label = preset if model is None else f"{preset}, model {model}"
    common = {
        "model": model,
        "data": data,
        "inner_steps": inner_steps,
        "batch_size": batch_size,
        "rounds": rounds,
        "wall": wall,
        "seed": seed,
        "eval_final_only": final_only or None,
    }
    results: dict[str, dict[str, Any]] = {}
    for mix in parse_mixes(mixes or DEFAULT_MIXES):
        done: dict[str, str] = {}  # what a run would be -> the variant that ran it
        for variant in [v for v in VARIANTS if v in names]:
            cfg = build_config(
                preset,
                algo="sparseloco",
                workers=len(mix),
                speeds=mix,
                **common,
                **VARIANTS[variant],
            )
            key = _identity(cfg)
            name = f"{mix_name(mix)}-{variant}"
            path = out / f"{name.replace(',', '_')}.json"
            if key in done:
                results[name] = {**results[f"{mix_name(mix)}-{done[key]}"], "same_as": done[key]}
                print(f"{label} mix {mix_name(mix)} {variant}: the same run as {done[key]}")
                continue
            done[key] = variant
            if path.exists():
                results[name] = json.loads(path.read_text())
                print(f"{label} mix {mix_name(mix)} {variant}: read {path}")
                continue
            title = f"{mix_name(mix)} {variant}"
            print(
                f"{label} mix {mix_name(mix)} {variant}: {cfg.rounds} rounds of"
                f" {cfg.round_plan().wall:g} step units, steps {list(cfg.round_plan().steps)}",
                flush=True,
            )
            start = time.perf_counter()
            with round_progress(title, cfg.rounds) as progress:
                res = simulate(cfg, progress=progress)
            write_json(res, path)
            results[name] = res
            print(
                f"{label} mix {mix_name(mix)} {variant}: final eval loss"
                f" {res['final_eval_loss']:.4f} in {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    doc = {"preset": label, "runs": {n: _row(r) for n, r in results.items()}}
    write_json(doc, out / "unequal.json")
    table = tables(doc)
    (out / "summary.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out}/ (one JSON per run, unequal.json, summary.md)")
    return doc


def _identity(cfg: Any) -> str:
    """What a run is: its config but the budget, plus the plan the budget makes (equal
    identities train the same, bit for bit)."""
    config = cfg.model_dump(mode="json")
    config.pop("timing")
    plan = cfg.round_plan()
    return json.dumps([config, plan.steps, plan.rows, plan.work, plan.wall], sort_keys=True)


def _row(res: dict[str, Any]) -> dict[str, Any]:
    keys = ("final_eval_loss", "rounds_run", "round_wall", "round_budget", "wall", "steps")
    row = {k: res[k] for k in keys}
    row |= {
        "rows": res["batch_rows"],
        "work": res["work_steps"],
        "tokens": res["tokens"],
        "tokens_per_worker": res["tokens_per_worker"],
        "work_weight": res["config"]["work_weight"],
        "budget": res["config"]["timing"]["budget"],
        "wall_seconds": res["wall_seconds"],
    }
    if "same_as" in res:
        row["same_as"] = res["same_as"]
    return row


def _cell(row: dict[str, Any] | None, best: float | None) -> str:
    if row is None:
        return "not run"
    loss = f"{row['final_eval_loss']:.4f}"
    if best is not None and row["final_eval_loss"] == best:
        loss = f"**{loss}**"
    tokens = row["tokens_per_worker"] / 1e3
    same = f", = {row['same_as']}" if "same_as" in row else ""
    return f"{loss} ({row['rounds_run']} r, {tokens:,.0f} k tok/w{same})"


def tables(doc: dict[str, Any]) -> str:
    """Markdown: the main table (best of a row in bold), the ablation, and per run the plan."""
    runs = doc["runs"]
    mix_names = list(dict.fromkeys(n.rsplit("-", 1)[0] for n in runs))
    lines = [f"preset: {doc['preset']}; a cell: final eval loss (rounds, mean tokens per worker)"]
    sections = (
        ("", MAIN),
        ("The ablation of (c): the work rule, and the fastest budget:", ABLATION),
    )
    for title, columns in sections:
        lines += ["", *([title, ""] if title else [])]
        lines += [f"| mix | {' | '.join(columns.values())} |", "|---|" + "---:|" * len(columns)]
        for mix in mix_names:
            row = {v: runs.get(f"{mix}-{v}") for v in columns}
            losses = [r["final_eval_loss"] for r in row.values() if r is not None]
            best = min(losses) if losses else None
            lines.append(f"| {mix} | {' | '.join(_cell(row[v], best) for v in columns)} |")
    lines += [
        "",
        "| run | rule | budget | rounds | round wall | B | steps per round | rows"
        " | tokens per worker | s |",
        "|---|---|---|---:|---:|---:|---|---|---|---:|",
    ]
    for name, r in runs.items():
        if "same_as" in r:
            continue
        tokens = ", ".join(f"{t / 1e3:,.0f} k" for t in r["tokens"])
        lines.append(
            f"| {name} | {r['work_weight']} | {r['budget']} | {r['rounds_run']} |"
            f" {r['round_wall']:.2f} | {r['round_budget']:.2f} | {r['steps']} | {r['rows']} |"
            f" {tokens} | {r['wall_seconds']:.0f} |"
        )
    return "\n".join(lines)
