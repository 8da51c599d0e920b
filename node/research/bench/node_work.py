"""The node's own work per round, in nanoseconds per parameter, on a large tensor set.

``python -m node.research.bench.node_work``: one real ``Worker`` on the 81 M-parameter shape
(``SHAPE``, the benchmark's model dict; ``--preset`` takes a model preset instead), with the
inner steps replaced by a no-op so that only what a round costs *besides* training is left. Per
round it runs what the daemon runs on its compute thread, in order, and times each part:

    bookkeeping | encode | save_trained | fingerprint | decode | aggregate_apply | settle
    | save_applied

- ``bookkeeping``: ``train_and_compress`` minus the inner steps (θ_r kept aside and put back,
  the pseudo-gradient, θ_r's fingerprint when it is not remembered yet);
- ``encode``: error feedback, the two mass sums, Top-k + quantise + code, the payload's sha256;
- ``save_trained``: ``save_submitting`` (the pending payload and the state file);
- ``fingerprint``: θ's fingerprint as the divergence check asks for it;
- ``decode``: validate ``--peers`` payloads (lazily, as the node does);
- ``aggregate_apply``: screen, aggregate and apply them;
- ``settle``: the own contribution's mass account;
- ``save_applied``: what the daemon does after applying (before this change: evaluation aside, a
  second full state file and θ_{r+1}'s fingerprint).

The error buffer starts as ``codec_bench.error_buffer`` (realistic magnitudes for the codec),
AdamW holds moments for every parameter (so the state is 16 B/param as in a real run), and the
peers' payloads are ``codec_bench``'s. Work handed to a background thread is timed where the
round waits for it; the process's CPU time per round (every thread, the writes behind included,
waited for at the round's end) is the last row. ``--json`` writes every sample. Evaluation is
left out (its cost is the eval schedule's business, ``RunConfig.eval_every``), as is everything
on the network.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

import node.compute.inner as inner_module
import node.compute.worker as worker_module
import node.daemon.pending as pending_module
from node.compute.model import PRESETS, ModelConfig
from node.compute.worker import Worker
from node.daemon.pending import PendingRound, save_idle, save_submitting
from node.research.bench.codec_bench import error_buffer
from protocol.codec import encode
from protocol.runconfig import RunConfig

T = TypeVar("T")

#: The benchmark's model: 81 M parameters (GPT-2-small width, 11 layers, a 2,048 context).
SHAPE = ModelConfig(d_model=768, n_layers=11, n_heads=12, ctx_len=2048, vocab_size=2048)
#: The name it is registered under for the length of a run.
SHAPE_NAME = "bench81m"

PARTS = (
    "bookkeeping",
    "encode",
    "save_trained",
    "fingerprint",
    "decode",
    "aggregate_apply",
    "settle",
    "save_applied",
)


@contextmanager
def _registered(preset: str | None) -> Iterator[str]:
    """The model preset to build: ``preset``, or ``SHAPE`` under ``SHAPE_NAME`` for the run."""
    if preset is not None:
        yield preset
        return
    PRESETS[SHAPE_NAME] = SHAPE
    try:
        yield SHAPE_NAME
    finally:
        del PRESETS[SHAPE_NAME]


@contextmanager
def _no_training() -> Iterator[None]:
    """Inner steps that take no time and leave θ as it is: only the round's other work is left."""
    real = inner_module.inner_step
    inner_module.inner_step = lambda *args, **kwargs: 0.0
    try:
        yield
    finally:
        inner_module.inner_step = real


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _make_worker(model: str, seed: int) -> Worker:
    run = RunConfig(name="bench", model=model, inner_steps=1, batch_size=1, rounds=1000)
    worker = Worker(run, run_id=run.run_id, node_id="node-0", slot=0)
    for name, e in worker.error.items():  # a realistic buffer for the codec
        e.copy_(error_buffer({name: tuple(e.shape)}, seed)[name])
    # AdamW moments for every parameter, as after any real step (16 B/param of state in all).
    for p in worker.model.parameters():
        p.grad = torch.zeros_like(p)
    worker.opt.step()
    worker.opt.zero_grad(set_to_none=True)
    return worker


def _peers(
    shapes: dict[str, tuple[int, ...]], n: int, topk: int, tile: int, seed: int
) -> list[bytes]:
    """``n`` peers' payloads of distinct error buffers (``codec_bench``'s stand-in)."""
    return [encode(error_buffer(shapes, seed + 1 + i), topk=topk, tile=tile)[0] for i in range(n)]


def _save_applied(state_dir: Path, worker: Worker) -> str:
    """What the daemon does after applying a round it trained: ``save_applied`` where this
    code has it, else (before issue 11) a second full state file."""
    step = getattr(pending_module, "save_applied", None)
    if step is None:
        return save_idle(state_dir, worker)
    return str(step(state_dir, worker, trained=True))


def one_round(worker: Worker, state_dir: Path, peers: list[bytes]) -> dict[str, float]:
    """Seconds of each part of one round (see the module docstring)."""
    seconds: dict[str, float] = {}
    r = worker.round
    result, total = _timed(worker.train_and_compress)
    seconds["bookkeeping"] = total - result.encode_s
    seconds["encode"] = result.encode_s
    pending = PendingRound.trained(r, result)
    _, seconds["save_trained"] = _timed(lambda: save_submitting(state_dir, worker, pending))
    _, seconds["fingerprint"] = _timed(worker.fingerprint)
    payloads, seconds["decode"] = _timed(
        lambda: {f"peer-{i:02d}": worker.read(data) for i, data in enumerate(peers)}
    )
    _, seconds["aggregate_apply"] = _timed(lambda: worker.apply(payloads))
    recon = pending.recon or {}
    _, seconds["settle"] = _timed(lambda: (worker.sent_mass(recon), worker.held_mass()))
    _, seconds["save_applied"] = _timed(lambda: _save_applied(state_dir, worker))
    return seconds


def run(
    *,
    preset: str | None = None,
    rounds: int = 3,
    peers: int = 16,
    seed: int = 0,
    state_dir: str | None = None,
    json_out: str | None = None,
) -> dict[str, Any]:
    """Rounds of the node's own work; prints the table and returns the samples."""
    hashed = 0
    real_fingerprint = worker_module.fingerprint

    def counting(tensors: Any) -> str:
        nonlocal hashed
        hashed += 1
        return real_fingerprint(tensors)

    with (
        _registered(preset) as model,
        _no_training(),
        tempfile.TemporaryDirectory(dir=state_dir) as tmp,
    ):
        worker = _make_worker(model, seed)
        params = sum(p.numel() for p in worker.params.values())
        run_cfg = worker.run
        peer_data = _peers(worker.shapes, peers, run_cfg.topk, run_cfg.tile, seed)
        worker_module.fingerprint = counting
        try:
            samples = []
            for _ in range(rounds + 1):  # the first round loads the compiled codec: left out
                hashed = 0
                cpu = time.process_time()
                seconds = one_round(worker, Path(tmp), peer_data)
                if hasattr(worker, "writes"):  # the code before issue 11 wrote nothing behind
                    worker.writes.wait()
                seconds["cpu"] = time.process_time() - cpu
                seconds["fingerprints_of_theta"] = hashed
                samples.append(seconds)
        finally:
            worker_module.fingerprint = real_fingerprint
    steady = samples[1:]
    ns = {p: 1e9 * statistics.median(s[p] for s in steady) / params for p in PARTS}
    report = {
        "params": params,
        "peers": peers,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "ns_per_param": ns,
        "total_ns_per_param": sum(ns.values()),
        "cpu_ns_per_param": 1e9 * statistics.median(s["cpu"] for s in steady) / params,
        "fingerprints_of_theta": statistics.median(s["fingerprints_of_theta"] for s in steady),
        "samples": samples,
    }
    print(markdown(report))
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(report, indent=2))
    return report


def markdown(report: dict[str, Any]) -> str:
    """The per-part table in ns/param, with the total."""
    ns = report["ns_per_param"]
    params = report["params"]
    rows = ["| part | ns/param | ms/round |", "|---|---:|---:|"]
    for part in PARTS:
        ms = ns[part] * params / 1e6
        rows.append(f"| {part.replace('_', ' ')} | {ns[part]:.1f} | {ms:.0f} |")
    total = report["total_ns_per_param"]
    rows.append(f"| **total on the round's path** | **{total:.1f}** | {total * params / 1e6:.0f} |")
    cpu = report["cpu_ns_per_param"]
    rows.append(
        f"| CPU time, all threads (writes behind too) | {cpu:.1f} | {cpu * params / 1e6:.0f} |"
    )
    head = (
        f"{params / 1e6:.1f} M parameters, {report['peers']} peers, median of"
        f" {report['rounds']} rounds, {report['threads']} torch threads,"
        f" {report['fingerprints_of_theta']:g} fingerprints of θ per round"
    )
    return "\n".join([head, "", *rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m node.research.bench.node_work", description=__doc__)
    p.add_argument("--preset", help=f"model preset (default: the {SHAPE_NAME} shape)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", type=int, default=16)
    p.add_argument("--state-dir", help="where the state files go (default: the temp dir)")
    p.add_argument("--json", dest="json_out", metavar="OUT")
    a = p.parse_args(argv)
    run(
        preset=a.preset,
        rounds=a.rounds,
        peers=a.peers,
        state_dir=a.state_dir,
        json_out=a.json_out,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
