"""``sparseloco bench wan``: round time and utilisation across the WAN lab, beside the projection.

For each link profile, model and schedule (plain, overlapped with ``overlap = "eager"``), one
real short run (``node.research.wan.cluster.run_in_lab``): store and coordinator in the lab's
server namespace, N node processes each behind the profile (all nodes on the same one, so the
round is the profile's, not a mix's). From the run's summary, over the steady rounds (round 0
loads the compiled codec and evaluates, round 1 carries round 0's first decode and apply, the
last round has nothing to overlap with, so rounds 2 .. R-2):

- **measured**: the mean round duration (the coordinator's, open to close) and utilisation,
  training seconds over wall seconds per node, then the mean over nodes
  (``node.research.bench.utilisation``);
- **projected**: ``projection.on_link`` for the same link with the measured inputs plugged in:
  training seconds and the node's own work (encode, decode, aggregate+apply, save) of the
  slowest node (``measured_inputs``), the payload's bytes and the gather size;
  utilisation is the nodes' mean training over that round, as measured.

The ratio measured / projected is what docs/benchmarks.md §17 diagnoses. Besides, per run, the
medians of the node's ``upload`` (grant + PUT), ``download`` (the GETs) and ``wait`` (submit to
manifest) phases, the relays' resets and the load average, for the diagnosis.

``lan`` is an extra profile, not the issue's: 1 Gbit/s both ways and no delay, through the same
namespaces, veths and relays, so its gap is the lab's and the machine's, not a link's.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path
from typing import Any

from node.cluster.up import UpConfig
from node.errors import UpError
from node.research.bench.projection import on_link
from node.research.bench.utilisation import utilisation
from node.research.bench.wire import Link, WireTimes, from_profile
from node.research.report import publish

log = logging.getLogger("sparseloco.bench.wan")

#: Model sizes: a run preset and what the benchmark changes in it to train in seconds on a
#: shared 2-core CPU. ``small`` (0.44 M parameters, a payload of about 8 KB: round trips
#: dominate); ``base`` (10.8 M, about 183 KB: a tenth of a second on a 20 Mbit/s uplink, with
#: H = 2 and batch 2 so that a round trains about as long as ``small``'s).
MODELS: dict[str, tuple[str, dict[str, int]]] = {
    "small": ("small", {"inner_steps": 10}),
    "base": ("base", {"inner_steps": 2, "batch_size": 2}),
}
#: The node's own work beside training, as ``bench round`` counts it (no network, no waits).
WORK = ("encode", "decode", "aggregate_apply", "save")
#: Of that, what overlap moves beside training: the payload checks (docs/benchmarks.md §13).
FREE = ("decode",)
#: Steady rounds start here (module docstring).
FIRST_STEADY = 2


def profiles(names: list[str]) -> dict[str, Any]:
    """The lab's profiles by name, plus ``lan`` (the lab without a link's delay); ``NAME@S``
    is profile NAME with a reset about every S seconds (``flaky@5``: a run of a minute sees
    several, where ``flaky``'s one a minute may land in none)."""
    from node.research.wan.profiles import PROFILES, LinkProfile

    known = {"lan": LinkProfile("lan", up_mbit=1000, down_mbit=1000, rtt_ms=0), **PROFILES}
    chosen = {}
    for name in names:
        base, _, every = name.partition("@")
        if base not in known:
            raise ValueError(f"unknown profile {name!r}; choose from {', '.join(known)}")
        try:
            chosen[name] = known[base].with_reset(float(every)) if every else known[base]
        except ValueError as exc:
            raise ValueError(f"profile {name!r}: NAME@SECONDS, e.g. flaky@5 ({exc})") from exc
    return chosen


def _steady(result: dict[str, Any]) -> list[dict[str, Any]]:
    rounds = sorted(result["rounds"], key=lambda e: e["round"])
    return rounds[FIRST_STEADY:-1]


def measured_inputs(result: dict[str, Any], overlapped: bool = False) -> dict[str, float]:
    """The projection's inputs as the run measured them over the steady rounds.

    Plain, every round waits for its slowest node: training and work are the mean over rounds
    of the slowest node's. Overlapped, a node that trained slowly in one round catches up in
    the next (it trains while it waits), so the run goes at the pace of the node slowest on
    average: the largest of the nodes' means.
    """
    rounds = _steady(result)
    if not rounds:
        raise ValueError(f"no steady rounds: run at least {FIRST_STEADY + 2} rounds")

    def seconds(phases: tuple[str, ...]) -> float:
        per_round = [
            {n: sum(t.get(p, 0.0) for p in phases) for n, t in e["timings"].items()} for e in rounds
        ]
        if not overlapped:
            return statistics.fmean(max(r.values()) for r in per_round)
        nodes = {n for r in per_round for n in r}
        return max(statistics.fmean(r[n] for r in per_round if n in r) for n in nodes)

    def median(phase: str) -> float:
        values = [t[phase] for e in rounds for t in e["timings"].values() if phase in t]
        return statistics.median(values) if values else 0.0

    nodes = [max(1, len(e["timings"])) for e in rounds]
    return {
        "train_s": seconds(("train",)),
        "work_s": seconds(WORK),
        "free_s": seconds(FREE),
        "payload_bytes": statistics.fmean(
            e["bytes_up"] / n for e, n in zip(rounds, nodes, strict=True)
        ),
        "peers": statistics.median(len(e["gather"]) for e in rounds),
        "upload_s": median("upload"),
        "download_s": median("download"),
        "wait_s": median("wait"),
    }


def compare(result: dict[str, Any], link: Link, overlapped: bool) -> dict[str, Any]:
    """Measured round and utilisation of one run beside the projection for ``link``, and
    beside benchmark 13's formula (bytes / rate only: the same link without its delay)."""
    inputs = measured_inputs(result, overlapped)
    ordered = sorted(result["rounds"], key=lambda e: e["round"])
    measured = utilisation({**result, "rounds": ordered[FIRST_STEADY - 1 :]})

    def projected(on: Link) -> tuple[WireTimes, float]:
        wire, plain, overlap = on_link(
            on,
            train_s=inputs["train_s"],
            work_s=inputs["work_s"],
            path_s=inputs["work_s"] - inputs["free_s"],
            payload=inputs["payload_bytes"],
            peers=round(inputs["peers"]),
        )
        return wire, overlap if overlapped else plain

    wire, round_s = projected(link)
    _, bytes_only = projected(Link(name=link.name, up_mbit=link.up_mbit, down_mbit=link.down_mbit))
    return {
        "inputs": inputs,
        "wire": wire.model_dump() | {"slow_start_s": wire.slow_start_s},
        "measured_round_s": measured["round_s"],
        "measured_util": measured["utilisation"],
        "projected_round_s": round_s,
        "projected_util": measured["train_s"] / round_s,
        "ratio": measured["round_s"] / round_s,
        "bytes_only_round_s": bytes_only,
        "bytes_only_ratio": measured["round_s"] / bytes_only,
    }


def run(
    json_out: str | None,
    *,
    profile_names: list[str],
    models: list[str],
    schedules: list[str],
    nodes: int,
    rounds: int,
    run_dir: str | None,
    from_json: str | None = None,
) -> dict[str, Any]:
    """Every (profile, model, schedule) run in turn; prints the table, returns the report.
    With ``from_json`` (``--from``), nothing runs: that saved report is compared ``again``."""
    from node.research.wan.cluster import run_in_lab

    if from_json:
        return again(from_json, json_out)
    if rounds < FIRST_STEADY + 2:
        raise ValueError(f"--rounds must be at least {FIRST_STEADY + 2} (steady rounds 2..R-2)")
    unknown = [m for m in models if m not in MODELS] + [
        s for s in schedules if s not in ("plain", "overlap")
    ]
    if unknown:
        raise ValueError(f"unknown model or schedule {unknown[0]!r}")
    chosen = profiles(profile_names)
    root = Path(run_dir) if run_dir else Path("runs") / "bench-wan"
    rows = []
    for name, profile in chosen.items():
        for model in models:
            preset, overrides = MODELS[model]
            for schedule in schedules:
                tag = f"{name}-{model}-{schedule}"
                log.info("event=bench_wan_run run=%s", tag)
                load_before = os.getloadavg()[0]
                cfg = UpConfig(
                    nodes=nodes,
                    rounds=rounds,
                    preset=preset,
                    run_dir=root / tag,
                    round_timeout_s=300.0,
                    eval_every=10_000,  # only the last round evaluates: no eval in steady rounds
                    overlap="eager" if schedule == "overlap" else None,
                )
                row: dict[str, Any] = {"profile": name, "model": model, "schedule": schedule}
                try:
                    result = run_in_lab(cfg, [profile], run_overrides=overrides)
                except UpError as exc:  # one failed run is a row that says so, not the end
                    log.warning("event=bench_wan_failed run=%s error=%r", tag, str(exc)[:500])
                    rows.append(row | {"error": str(exc)})
                    print(f"| {name} | {model} | {schedule} | failed: {str(exc)[:80]!r} |")
                    continue
                row |= compare(result, from_profile(name, profile), schedule == "overlap")
                row |= {
                    "load": [load_before, os.getloadavg()[0]],
                    "resets": sum(result["resets"].values()),
                    "fingerprints_agree": result["fingerprints_agree"],
                    "rounds": result["rounds"],
                }
                rows.append(row)
                print(markdown_row(row), flush=True)
    report = {"nodes": nodes, "rounds": rounds, "models": MODELS, "rows": rows}
    publish(markdown(rows), report, json_out)
    return report


def again(path: str, json_out: str | None = None) -> dict[str, Any]:
    """A saved report's runs compared again with the projection as it is now (after a change
    to the formula, nothing run); prints the table and returns the new report."""
    report = json.loads(Path(path).read_text())
    chosen = profiles(sorted({r["profile"] for r in report["rows"]}))
    rows = []
    for old in report["rows"]:
        if "error" in old:
            rows.append(old)
            continue
        link = from_profile(old["profile"], chosen[old["profile"]])
        new = compare({"rounds": old["rounds"]}, link, old["schedule"] == "overlap")
        rows.append(old | new)
    report = report | {"rows": rows}
    publish(markdown(rows), report, json_out)
    return report


HEADER = (
    "| profile | model | schedule | measured round s | projected round s | measured/projected"
    " | measured util | projected util | bytes-only round s (ratio) | train s | work s"
    " | payload KB | upload s | download s | wait s | resets | load |\n"
    "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def markdown_row(r: dict[str, Any]) -> str:
    i = r["inputs"]
    return (
        f"| {r['profile']} | {r['model']} | {r['schedule']} | {r['measured_round_s']:.2f}"
        f" | {r['projected_round_s']:.2f} | {r['ratio']:.2f} | {r['measured_util']:.1%}"
        f" | {r['projected_util']:.1%}"
        f" | {r['bytes_only_round_s']:.2f} ({r['bytes_only_ratio']:.2f})"
        f" | {i['train_s']:.2f} | {i['work_s']:.2f}"
        f" | {i['payload_bytes'] / 1e3:.0f} | {i['upload_s']:.2f} | {i['download_s']:.2f}"
        f" | {i['wait_s']:.2f} | {r['resets']} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |"
    )


def markdown(rows: list[dict[str, Any]]) -> str:
    done = [r for r in rows if "error" not in r]
    failed = [f"failed: {r['profile']} {r['model']} {r['schedule']}" for r in rows if "error" in r]
    return "\n".join([HEADER, *(markdown_row(r) for r in done), *failed])
