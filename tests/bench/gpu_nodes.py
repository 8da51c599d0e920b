"""GPU nodes beside a CPU node in one real run: bit-identical θ every round, and their speed.

    python tests/bench/gpu_nodes.py [--model llama_1b] [--gpu-nodes 2] [--cpu-nodes 1]
        [--rounds 3] [--inner-steps 2] [--batch-size 1] [--dir DIR] [--json OUT]
    python tests/bench/gpu_nodes.py --smoke      # llama_tiny, every node on the CPU: seconds

Starts what ``sparseloco up`` starts (SeaweedFS, a coordinator, real ``sparseloco node``
processes on loopback), with ``--gpu-nodes`` nodes on ``--device cuda:0`` (all sharing the one
GPU) and ``--cpu-nodes`` on ``--device cpu``, for ``--rounds`` rounds of ``--model``. θ, the
error buffer, the codec and the aggregation stay on the CPU on every node, so every node must
report the same fingerprint after every round (exit 1 otherwise). Prints each node's tokens/s
and MFU per round, from its round reports. Usually run through ``gpu_check.py``, which adds
the device codec check and writes one JSON summary.

Disk: every node keeps θ, e and AdamW on disk (16 B/param, up to 28 while a round's files
replace the previous ones; the check reserves 24). Where the run folder's disk cannot hold
that for every node, the check first drops to one GPU node (a GPU node beside a CPU node is
what it is for), then to ``llama_512m``, and says so (``fallback`` in the summary). The CPU
node gets most of the machine's cores; a GPU node needs a few for the codec.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

#: Bytes of disk per parameter per node the check reserves (θ, e, AdamW, files being replaced).
DISK_BYTES_PER_PARAM = 24
FALLBACK_MODEL = "llama_512m"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return ap.parse_args(argv)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of this check (``gpu_check.py`` takes them too)."""
    ap.add_argument("--model", default="llama_1b", help="model preset (default llama_1b)")
    ap.add_argument("--gpu-nodes", type=int, default=2)
    ap.add_argument("--cpu-nodes", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner-steps", type=int, default=2, help="H (default 2)")
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per inner step")
    ap.add_argument("--round-timeout", type=float, default=1800.0, help="seconds per round")
    ap.add_argument("--dir", dest="run_dir", help="run folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the run folder afterwards")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the CPU check of this script: llama_tiny, 2 rounds, every node on --device cpu",
    )
    ap.add_argument(
        "--ranked-model",
        default="llama_bpe4k_12m",
        help="model of the sharded-node part: a 1-GPU torchrun node (its outer state on the GPU)"
        " beside a torchrun node of --cpu-ranks processes on the CPU (gloo)",
    )
    ap.add_argument("--cpu-ranks", type=int, default=4, help="processes of the CPU FSDP node")
    ap.add_argument("--no-ranked", dest="ranked", action="store_false", help="skip that part")


def _params(model: str) -> int:
    from node.compute.model import get_preset, param_count

    return param_count(get_preset(model))


def _fit(model: str, gpu_nodes: int, cpu_nodes: int, run_dir: Path) -> tuple[str, int, str | None]:
    """The model and GPU node count to run: as asked if the run folder's disk holds every
    node's state, else one GPU node, else the fallback model; and why, if changed."""
    free = shutil.disk_usage(run_dir).free

    def fits(m: str, g: int) -> bool:
        return (g + cpu_nodes) * DISK_BYTES_PER_PARAM * _params(m) <= free

    need = (gpu_nodes + cpu_nodes) * DISK_BYTES_PER_PARAM * _params(model)
    where = f"{run_dir} has {free / 1e9:.0f} GB free, {need / 1e9:.0f} GB needed"
    if fits(model, gpu_nodes):
        return model, gpu_nodes, None
    if gpu_nodes > 1 and cpu_nodes >= 1 and fits(model, 1):
        return model, 1, f"{where}: one GPU node instead of {gpu_nodes} (--dir elsewhere)"
    if _params(model) > _params(FALLBACK_MODEL):
        return FALLBACK_MODEL, gpu_nodes, f"{where}: {FALLBACK_MODEL} instead of {model}"
    return model, gpu_nodes, None


def _threads(gpu_nodes: int, cpu_nodes: int) -> list[int]:
    """Threads per node: a few for each GPU node (its codec), the rest shared by CPU nodes."""
    cores = os.cpu_count() or 1
    gpu = min(4, max(1, cores // (2 * max(1, gpu_nodes + cpu_nodes))))
    rest = max(1, cores - gpu * gpu_nodes)
    return [gpu] * gpu_nodes + [max(1, rest // max(1, cpu_nodes))] * cpu_nodes


def run_nodes(args: argparse.Namespace) -> dict[str, Any]:
    """Run the check; its summary (``ok`` says whether every round agreed)."""
    if args.smoke:
        args.model, args.rounds, args.inner_steps, args.batch_size = "llama_tiny", 2, 2, 2
    made = args.run_dir is None
    if made:
        Path("runs").mkdir(exist_ok=True)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="gpu-nodes-", dir="runs"))
    run_dir.mkdir(parents=True, exist_ok=True)
    model, gpu_nodes, fallback = _fit(args.model, args.gpu_nodes, args.cpu_nodes, run_dir)
    if fallback:
        print(f"gpu_nodes: {fallback}")
    gpu = "cpu" if args.smoke else "cuda:0"
    devices = [gpu] * gpu_nodes + ["cpu"] * args.cpu_nodes
    threads = _threads(gpu_nodes, args.cpu_nodes)
    return _run(args, run_dir, made, model, devices, None, threads, fallback, "gpu_nodes")


def run_ranked(args: argparse.Namespace) -> dict[str, Any]:
    """The sharded-node part: a node of one process under ``--ranks 1`` on the GPU (θ, e, the
    codec and the aggregation on the device) beside a node of ``--cpu-ranks`` processes on the
    CPU (FSDP over gloo, the outer state sharded over them). Every round must agree."""
    model = "llama_tiny" if args.smoke else args.ranked_model
    cpu_ranks = 2 if args.smoke else args.cpu_ranks
    batch = max(args.batch_size, cpu_ranks)
    Path("runs").mkdir(exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="gpu-ranked-", dir="runs"))
    gpu = "cpu" if args.smoke else "cuda:0"
    cores = os.cpu_count() or 1
    threads = [min(4, cores), max(1, (cores - 4) // cpu_ranks)]
    ranked = argparse.Namespace(**{**vars(args), "batch_size": batch})
    devices, ranks = [gpu, "cpu"], [1, cpu_ranks]
    return _run(ranked, run_dir, True, model, devices, ranks, threads, None, "gpu_ranked")


def _run(
    args: argparse.Namespace,
    run_dir: Path,
    remove: bool,
    model: str,
    devices: list[str],
    ranks: list[int] | None,
    threads: list[int],
    fallback: str | None,
    label: str,
) -> dict[str, Any]:
    """One ``up`` run of these nodes (``ranks``: each one's ``--ranks``; None: plain
    processes); its summary. ``label`` names the logs' folder in $OUT."""
    from node.cluster.up import UpConfig, up
    from node.errors import UpError

    nodes = len(devices)
    shown = (
        list(devices)
        if ranks is None
        else [f"{d} x{r}" for d, r in zip(devices, ranks, strict=True)]
    )
    print(
        f"gpu_nodes: {nodes} nodes ({', '.join(shown)}; threads {threads}) on {model}"
        f" ({_params(model) / 1e6:,.1f} M parameters), H={args.inner_steps},"
        f" batch {args.batch_size}, {args.rounds} rounds; run folder {run_dir}"
    )
    cfg = UpConfig(
        nodes=nodes,
        rounds=args.rounds,
        preset="llama",
        run_dir=run_dir,
        round_timeout_s=args.round_timeout,
        device=",".join(devices),
        ranks=None if ranks is None else ",".join(map(str, ranks)),
    )
    overrides = {
        "model": model,
        "inner_steps": args.inner_steps,
        "batch_size": args.batch_size,
        "checkpoint_every": 0,  # no checkpoint uploads: this checks training, not the store
        "eval_every": 10**6,  # the first and the last round only
    }
    # One short held-out batch: a CPU node evaluating a 1 B model longer would hold every round.
    env = {"SPARSELOCO_NODE_EVAL_BATCHES": "1", "SPARSELOCO_NODE_EVAL_BATCH_SIZE": "1"}
    if ranks and max(ranks) > 1:  # every process of a node evaluates its rows of the batch
        env["SPARSELOCO_NODE_EVAL_BATCH_SIZE"] = str(max(ranks))
    t0 = time.monotonic()
    try:
        result = up(cfg, run_overrides=overrides, node_env=env, node_threads=threads)
    except UpError as exc:  # a process died or a round stalled: say so in the summary
        print(f"gpu_nodes: FAILED: {exc}")
        result = {"rounds": [], "final_eval_loss": None, "error": str(exc)}
    finally:
        out = os.environ.get("OUT")
        if out and (run_dir / "logs").is_dir():  # the logs travel back with the summary
            logs = Path(out) / f"{label}-logs"
            shutil.copytree(run_dir / "logs", logs, dirs_exist_ok=True)
        if remove and not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return summarize(result, shown, model, fallback, time.monotonic() - t0, args)


def summarize(
    result: dict[str, Any],
    devices: list[str],
    model: str,
    fallback: str | None,
    wall_s: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The check's verdict and table from ``up``'s result; prints the table."""
    names = [f"node-{i}" for i in range(len(devices))]
    failures = [result["error"]] if "error" in result else []
    rounds = result["rounds"]
    if len(rounds) != args.rounds:
        failures.append(f"{len(rounds)} rounds closed, {args.rounds} expected")
    print("| round | node | device | tokens/s | MFU | fingerprint |\n|---|---|---|---:|---:|---|")
    for entry in rounds:
        fps = entry["fingerprints"]
        if sorted(fps) != names or len(set(fps.values())) != 1:
            failures.append(f"round {entry['round']}: fingerprints {fps}")
        for name, device in zip(names, devices, strict=True):
            speed = entry["throughput"].get(name, {})
            tps, mfu = speed.get("tokens_per_s"), speed.get("mfu")
            if tps is None:
                failures.append(f"round {entry['round']}: {name} reported no tokens/s")
            print(
                f"| {entry['round']} | {name} | {device} | "
                + ("-" if tps is None else f"{tps:,.0f}")
                + " | "
                + ("-" if mfu is None else f"{100 * mfu:.1f} %")
                + f" | {fps.get(name, '-')[:12]} |"
            )
    per_node = {}
    for name, device in zip(names, devices, strict=True):
        # The first round pays for warm-up (kernel selection, allocator): the rest is the speed.
        later = [e["throughput"].get(name, {}) for e in rounds[1:]] or [
            e["throughput"].get(name, {}) for e in rounds
        ]
        tps = [s["tokens_per_s"] for s in later if s.get("tokens_per_s") is not None]
        mfu = [s["mfu"] for s in later if s.get("mfu") is not None]
        per_node[name] = {
            "device": device,
            "tokens_per_s": sum(tps) / len(tps) if tps else None,
            "mfu": sum(mfu) / len(mfu) if mfu else None,
        }
    phases = ("train", "encode", "save", "decode", "aggregate_apply")
    print("\n| node | device | " + " | ".join(f"{p} s" for p in phases) + " |")
    print("|---|---|" + "---:|" * len(phases))
    for name, device in zip(names, devices, strict=True):
        # Median over the rounds after the first: the node's own work beside its training.
        seen = [e["timings"].get(name, {}) for e in rounds[1:]] or [
            e["timings"].get(name, {}) for e in rounds
        ]
        cells = []
        for phase in phases:
            values = sorted(t[phase] for t in seen if phase in t)
            cells.append(f"{values[len(values) // 2]:.3f}" if values else "-")
        print(f"| {name} | {device} | " + " | ".join(cells) + " |")
    ok = not failures
    loss = result["final_eval_loss"]
    print(
        f"gpu_nodes: {'OK' if ok else 'FAILED'}: {len(rounds)} rounds, fingerprints"
        f" {'identical on all nodes every round' if ok else 'or reports wrong'};"
        f" final eval loss {'-' if loss is None else f'{loss:.4f}'}; {wall_s:.0f} s"
    )
    for failure in failures:
        print(f"  {failure}")
    return {
        "ok": ok,
        "failures": failures,
        "model": model,
        "fallback": fallback,
        "devices": devices,
        "inner_steps": args.inner_steps,
        "batch_size": args.batch_size,
        "wall_s": wall_s,
        "per_node": per_node,
        "final_eval_loss": result["final_eval_loss"],
        "rounds": [
            {k: e[k] for k in ("round", "fingerprints", "throughput", "timings", "duration_s")}
            for e in rounds
        ],
    }


def main(argv: list[str] | None = None) -> int:
    import json

    args = parse_args(argv)
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            print("gpu_nodes: no CUDA device visible to torch; nothing checked (or use --smoke)")
            return 0
    summary = run_nodes(args)
    if args.ranked:
        summary["ranked"] = run_ranked(args)
        summary["ok"] = summary["ok"] and summary["ranked"]["ok"]
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "gpu_nodes.json"
        path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"gpu_nodes: wrote {path}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
