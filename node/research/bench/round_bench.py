"""``sparseloco bench round``: where the time of a networked round goes.

Runs ``sparseloco up`` (embedded SeaweedFS, a coordinator and N node processes on loopback) and
collects the per-phase timings every node reported for every round it took part in:

    train | encode | upload | wait | download | decode | aggregate+apply | save | eval

``wait`` is from the node's submit to the manifest's arrival: the slowest peer's train and
upload plus the coordinator's close, i.e. the synchronisation cost. The round itself is
measured by the coordinator (first expected node to close). Round 0 is reported separately from
the steady state, since it includes the compiled codec loops loading in every process.

Each phase is the median over every (node, round) report, except ``eval``: nodes evaluate on
the run's schedule (``RunConfig.eval_every``), so its cost is the mean over all reports, a
round without evaluation counting 0 (amortised). ``own`` is the node's own work beside
training (encode, decode, aggregate+apply, save, eval), without the network and the waits
(benchmark 1's business): the share issue 11 sets a target for.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from node.cluster.up import UpConfig, up
from node.research.report import publish

log = logging.getLogger("sparseloco.bench.round")

PHASES = (
    "train",
    "merge_wait",  # (overlap "merge") standing at step τ for the transfers: not training
    "encode",
    "upload",
    "wait",
    "download",
    "decode",
    "aggregate_apply",
    "save",
    "eval",
)


#: What a bench's report says of the runs it timed (``UpConfig`` fields).
DESCRIBED = {"nodes", "rounds", "preset"}

#: The node's own work beside training: what is left when the network and the waits are not.
OWN = ("encode", "decode", "aggregate_apply", "save", "eval")


def phase_table(result: dict[str, Any], skip_first: bool = True) -> dict[str, float]:
    """Median seconds per phase over every (node, round) report, and the round duration."""
    samples: dict[str, list[float]] = {p: [] for p in PHASES}
    durations = []
    for entry in result["rounds"]:
        if skip_first and entry["round"] == 0:
            continue
        if entry["duration_s"] is not None:
            durations.append(entry["duration_s"])
        for timings in entry["timings"].values():
            for phase in PHASES:
                if phase in timings:
                    samples[phase].append(timings[phase])
                elif phase == "eval" and "train" in timings:
                    samples[phase].append(0.0)  # a trained round off the evaluation schedule
    out = {p: statistics.median(v) for p, v in samples.items() if v and p != "eval"}
    if samples["eval"]:
        out["eval"] = statistics.fmean(samples["eval"])
    if durations:
        out["round"] = statistics.median(durations)
    return out


def markdown(table: dict[str, float]) -> str:
    total = sum(table.get(p, 0.0) for p in PHASES)
    head = "| phase | median s | share |\n|---|---:|---:|"
    rows = [
        f"| {p.replace('_', '+')} | {table[p]:.3f} | {100 * table[p] / total:.1f} % |"
        for p in PHASES
        if p in table
    ]
    non_train = total - table.get("train", 0.0)
    own = sum(table.get(p, 0.0) for p in OWN)
    own_share = 100 * own / (own + table.get("train", 0.0))
    rows.append(f"| sum of phases | {total:.3f} | |")
    rows.append(f"| non-training share | {non_train:.3f} | {100 * non_train / total:.1f} % |")
    rows.append(f"| own work (no network, no waits) vs training | {own:.3f} | {own_share:.1f} % |")
    if "round" in table:
        rows.append(f"| round (coordinator: open to close) | {table['round']:.3f} | |")
    return "\n".join([head, *rows])


def one_run(runs: UpConfig, name: str | None = None, **changes: Any) -> UpConfig:
    """One ``up`` run of a bench: ``runs`` (what the bench's flags set) with ``changes`` (checked
    as ``UpConfig`` fields), in its own folder ``run_dir/name`` when named."""
    fields = runs.model_dump(exclude_unset=True)
    if name is not None and runs.run_dir is not None:
        fields["run_dir"] = runs.run_dir / name
    return UpConfig(**{**fields, **changes})


def run(json_out: str | None, *, runs: UpConfig, eval_every: int | None = None) -> dict[str, Any]:
    result = up(one_run(runs, data=None, round_timeout_s=120.0, eval_every=eval_every))
    table = phase_table(result)
    report = {**runs.model_dump(include=DESCRIBED), "phases": table, "up": result}
    publish(markdown(table), report, json_out)
    return report
