"""``sparseloco bench overlap``: how much of the wall time nodes spend training, on capped links,
with and without overlap.

Three runs of ``sparseloco up`` with the same preset and nodes (real SeaweedFS, coordinator and
node processes on loopback):

1. **calibrate**: plain, links uncapped. Per (node, round): the training seconds and the bytes
   sent and received. The cap is then chosen so that a round's transfers take ``link_share``
   times the training: ``rate = (bytes up + bytes down) / (link_share · train seconds)``, one
   rate for both directions (medians over the steady rounds).
2. **plain** with that cap on every node's uploads and downloads (``--upload-limit``,
   ``--download-limit``: the token buckets of ``node.daemon.ratelimit``; this kernel has no
   ``netem``);
3. one run per overlap schedule asked for (``merge`` at the run's default τ unless told
   otherwise; ``--variant merge:10,eager`` runs merge at τ = 10 and then eager) with the same
   cap, so every ratio comes from one invocation on the same links.

Utilisation = Σ training seconds / Σ round durations over the steady rounds, per node, then the
mean over nodes; and the same for the node that trained longest in each round (the one the round
waits for: nodes sharing a machine's cores do not train equally fast). A round's duration is the
coordinator's, from open to close; rounds follow each other, so the durations of consecutive
rounds add up to the wall time from the first one's open to the last one's close. Round 0
(compiled codec loops loading in every process; under overlap nothing in flight yet) and the
last round (nothing left to overlap with) are left out.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from node.cluster.up import UpConfig, up
from node.research.bench.round_bench import DESCRIBED, one_run, phase_table
from node.research.report import publish

log = logging.getLogger("sparseloco.bench.overlap")


def steady(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rounds of an ``up`` summary that are neither the first nor the last."""
    rounds = sorted(result["rounds"], key=lambda e: e["round"])
    return rounds[1:-1]


def utilisation(result: dict[str, Any]) -> dict[str, Any]:
    """Training share of the wall time over the steady rounds: per node and the mean."""
    rounds = steady(result)
    wall = sum(e["duration_s"] or 0.0 for e in rounds)
    trained: dict[str, float] = {}
    slowest = 0.0  # the node that trained longest each round: the one the round waits for
    for entry in rounds:
        times = {node: t.get("train", 0.0) for node, t in entry["timings"].items()}
        for node, seconds in times.items():
            trained[node] = trained.get(node, 0.0) + seconds
        slowest += max(times.values(), default=0.0)
    if wall <= 0 or not trained:
        raise ValueError("no steady rounds with timings: run at least 3 rounds")
    per_node = {node: t / wall for node, t in sorted(trained.items())}
    return {
        "utilisation": statistics.fmean(per_node.values()),
        "slowest": slowest / wall,
        "per_node": per_node,
        "wall_s": wall,
        "rounds": len(rounds),
        "round_s": wall / len(rounds),
        "train_s": statistics.fmean(trained.values()) / len(rounds),
    }


def link_rate(result: dict[str, Any], link_share: float) -> float:
    """Bytes per second at which a steady round's transfers take ``link_share`` × training."""
    samples = []
    for entry in steady(result):
        nodes = max(1, len(entry["timings"]))
        moved = (entry["bytes_up"] + entry["bytes_down"]) / nodes
        for timings in entry["timings"].values():
            if timings.get("train"):
                samples.append(moved / (link_share * timings["train"]))
    if not samples:
        raise ValueError("the calibration run reported no training time")
    return statistics.median(samples)


def schedules(spec: str) -> list[tuple[str, int | None]]:
    """``"merge,merge:10,eager"`` as (overlap, τ or None) pairs; ``ValueError`` if malformed."""
    out: list[tuple[str, int | None]] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, tau = item.partition(":")
        if name not in ("delayed", "eager", "merge") or (tau and name != "merge"):
            raise ValueError(f"unknown schedule {item!r}: use delayed, eager, merge or merge:TAU")
        if tau and not (tau.isdigit() and int(tau) >= 1):
            raise ValueError(f"{item!r}: τ must be a whole number of inner steps, at least 1")
        out.append((name, int(tau) if tau else None))
    if not out:
        raise ValueError("name at least one overlap schedule")
    return out


def label(overlap: str, tau: int | None) -> str:
    return overlap if tau is None else f"{overlap}:{tau}"


def markdown(report: dict[str, Any]) -> str:
    rate = report["rate_bytes_s"]
    lines = [
        f"link cap: {rate * 8 / 1e3:.1f} kbit/s each way per node"
        f" (transfers ≈ {report['link_share']:g} × training)",
        "",
        "| schedule | utilisation, mean of nodes | slowest node | round s | training s"
        " | final eval loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, u in report["runs"].items():
        loss = report["final_eval_loss"].get(name)
        lines.append(
            f"| {name} | {u['utilisation']:.3f} | {u['slowest']:.3f} | {u['round_s']:.2f}"
            f" | {u['train_s']:.2f} | {'-' if loss is None else f'{loss:.4f}'} |"
        )
    return "\n".join(lines)


def run(
    json_out: str | None,
    *,
    runs: UpConfig,
    link_share: float = 1.0,
    overlap: str = "merge",
) -> dict[str, Any]:
    if runs.rounds < 3:
        raise ValueError("--rounds must be at least 3 (the first and last are not steady)")
    asked = schedules(overlap)

    def one(name: str, **options: Any) -> dict[str, Any]:
        log.info("event=bench_overlap_run run=%s", name)
        return up(one_run(runs, name, round_timeout_s=600.0, **options))

    calibration = one("uncapped")
    rate = link_rate(calibration, link_share)
    cap = f"{rate:.0f}"  # bytes per second
    results = {"uncapped": calibration}
    results["plain"] = one("plain", upload_limit=cap, download_limit=cap)
    for name, tau in asked:
        results[label(name, tau)] = one(
            label(name, tau).replace(":", "-tau-"), overlap=name, overlap_tau=tau,
            upload_limit=cap, download_limit=cap,
        )  # fmt: skip
    report = {
        **runs.model_dump(include=DESCRIBED),
        "link_share": link_share,
        "rate_bytes_s": rate,
        "schedules": [label(name, tau) for name, tau in asked],
        "runs": {name: utilisation(result) for name, result in results.items()},
        # Median seconds per phase (``bench round``'s table) of each run, for the diagnosis.
        "phases": {name: phase_table(result) for name, result in results.items()},
        "final_eval_loss": {name: result["final_eval_loss"] for name, result in results.items()},
        "fingerprints_agree": all(r["fingerprints_agree"] for r in results.values()),
    }
    publish(markdown(report), report, json_out)
    return report
