"""``sparseloco bench robust``: hostile workers against robust aggregation, in one process.

The simulator's SparseLoCo loop (``node.research.simulate``) with the last ``attackers`` of
``workers`` hostile (``node.research.bench.hostile``: sign flip, noise, a huge tile or entry,
a replay of a peer's previous payload, an update trained from θ three rounds old). Every
scenario runs with robust aggregation on and off, next to the clean run and the run without the
attackers (the honest workers alone, on the same data streams), so the table says both whether
an attack hurts and whether the defence removes the harm. Same token budget everywhere.
"""

from __future__ import annotations

from typing import Any

import torch

from node.compute.outer import (
    AggregateOptions,
    apply_aggregate,
    compress,
    feed_error,
    pseudo_gradient,
)
from node.research.bench.hostile import KINDS, STALE_ROUNDS, hostile_tensors
from node.research.report import publish
from node.research.simulate import SimConfig, Simulation, _sync, build_config
from protocol.codec import decode, encode, read_payload
from protocol.fingerprint import fingerprint

ATTACKS = KINDS


def run(cfg: SimConfig, attack: str | None, attackers: int, absent: bool) -> dict[str, Any]:
    """One simulated run; ``absent`` leaves the attackers out (their data streams unused)."""
    torch.manual_seed(cfg.seed)
    sim = Simulation(cfg)
    theta = sim.params(sim.global_model)
    workers = sim.replicas()
    errors = [{n: torch.zeros_like(t) for n, t in theta.items()} for _ in workers]
    shapes = {n: tuple(t.shape) for n, t in theta.items()}
    hostile = set(range(cfg.workers - attackers, cfg.workers)) if attack or absent else set()
    history: list[dict[str, torch.Tensor]] = []
    previous: dict[str, bytes] = {}
    screened = 0
    sim.record(0, None)
    for r in range(cfg.rounds):
        _sync(workers, theta)
        history.append({n: t.clone() for n, t in theta.items()})
        base = fingerprint(theta)
        old = history[max(0, len(history) - 1 - STALE_ROUNDS)]
        if attack == "stale":
            for w in hostile:
                _sync([workers[w]], old)
        sim.train_workers(workers, r)
        payloads, sent = {}, {}
        for w, (model, _) in enumerate(workers):
            if absent and w in hostile:
                continue
            node = f"w{w:03d}"
            start = old if attack == "stale" and w in hostile else theta
            feed_error(errors[w], pseudo_gradient(start, sim.params(model)), cfg.beta)
            before = {n: t.clone() for n, t in errors[w].items()}
            data, recon = compress(
                errors[w], topk=cfg.topk, tile=cfg.tile, round=r, node_id=node, base=base
            )
            if w in hostile and attack not in (None, "stale"):
                peer = previous.get("w000")
                if attack != "replay" or peer is not None:
                    prev = decode(peer, shapes) if peer is not None else None
                    bad = hostile_tensors(attack, recon, before, seed=r, previous=prev)
                    data, _ = encode(
                        bad, topk=cfg.topk, tile=cfg.tile, round=r, node_id=node, base=base
                    )
            sent[node] = data
            payloads[node] = read_payload(data, shapes, topk=cfg.topk, tile=cfg.tile, lazy=True)
        previous = sent
        screening = apply_aggregate(
            theta, payloads, AggregateOptions(alpha=cfg.alpha, clip=cfg.clip, robust=cfg.robust)
        )
        screened += len(screening.rejected)
        sim.record(r + 1, None)
    return {"final_eval_loss": sim.curve[-1][1], "screened": screened}


def robust_table(preset: str, workers: int, attackers: int, rounds: int | None) -> dict[str, Any]:
    """Every scenario, robust aggregation on and off; the rows of the table."""
    rows: dict[str, Any] = {}
    for robust in (True, False):
        cfg = build_config(preset, algo="sparseloco", workers=workers, rounds=rounds)
        cfg = cfg.model_copy(update={"robust": robust})
        tag = "on" if robust else "off"
        rows[f"clean/{tag}"] = run(cfg, None, attackers, absent=False)
        rows[f"absent/{tag}"] = run(cfg, None, attackers, absent=True)
        for attack in ATTACKS:
            rows[f"{attack}/{tag}"] = run(cfg, attack, attackers, absent=False)
    return {"preset": preset, "workers": workers, "attackers": attackers, "rows": rows}


def markdown(table: dict[str, Any]) -> str:
    rows = table["rows"]
    out = [
        f"{table['attackers']} hostile of {table['workers']} workers, preset {table['preset']}:",
        "",
        "| run | robust on: final loss | vs absent | screened (worker-rounds) |"
        " robust off: final loss | vs absent |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    absent_on = rows["absent/on"]["final_eval_loss"]
    absent_off = rows["absent/off"]["final_eval_loss"]
    for name in ("clean", "absent", *ATTACKS):
        on, off = rows[f"{name}/on"], rows[f"{name}/off"]
        out.append(
            f"| {name} | {on['final_eval_loss']:.4f} |"
            f" {100 * (on['final_eval_loss'] / absent_on - 1):+.2f} % | {on['screened']} |"
            f" {off['final_eval_loss']:.4f} |"
            f" {100 * (off['final_eval_loss'] / absent_off - 1):+.2f} % |"
        )
    return "\n".join(out)


def run_bench(
    preset: str, workers: int, attackers: int, rounds: int | None, json_out: str | None
) -> dict[str, Any]:
    table = robust_table(preset, workers, attackers, rounds)
    publish(markdown(table), table, json_out)
    return table
