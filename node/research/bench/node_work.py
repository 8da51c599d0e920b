"""The node's own work per round, per rank, for nodes of 1, 2, 4... processes.

``sparseloco bench node-work`` (or ``python -m node.research.bench.node_work``): for each rank
count of ``--ranks``, a node of that many spawned processes (gloo on loopback, what torchrun
starts) builds its real ``Worker``s on the 81 M-parameter shape (``SHAPE``; ``--preset`` takes a
model preset instead) and runs, rank by rank, what the daemon's ops run for a round it trains,
``--peers`` payloads of other nodes included, timing each part on every rank:

    bookkeeping | encode | save_trained | fingerprint | decode | aggregate_apply | settle
    | save_applied

- ``bookkeeping``: ``train_and_compress`` minus the inner steps and the encode (θ into the
  model that trains, the pseudo-gradient back; on several ranks FSDP's chunks both ways);
- ``encode``: error feedback, the mass sums, Top-k + quantise + code (each rank its tensors),
  rank 0 assembling the payload and its sha256;
- ``save_trained``: the commit after training (every rank its e; rank 0 the payload);
- ``fingerprint``: θ's fingerprint as the divergence check asks for it;
- ``decode``: validate the peers' payloads, each rank its tensors' records, from files;
- ``aggregate_apply``: screen (counts summed over the ranks), aggregate and apply;
- ``settle``: the own contribution's mass account;
- ``save_applied``: θ_{r+1}'s fingerprint and its write behind.

A node of one rank is a plain process (``sparseloco node`` without torchrun: θ in the model,
no FSDP); more ranks are what torchrun starts. The ranks meet at a barrier before every part,
so a part's time on the node is its slowest rank's. By default the inner steps are a no-op
(only the round's other work is left); with ``--train-steps`` they are real (FSDP on several
ranks), which is what the peak RSS needs: each rank's high-water mark of resident memory
(``VmHWM``) above an idle process that imported torch and the node. The error buffer starts as
``codec_bench.error_buffer``, AdamW holds moments for every parameter. ``--json`` writes every
sample. Nothing here touches the network.

Each rank also marks its resident memory after each stage (``STAGES``: the process group,
``torch._dynamo``, θ/e/model, AdamW, the first inner step, the codec, the rest of the first
round, the later rounds); ``memory_parts`` turns the largest rank's marks into what each stage
added, with the part that is pages of files (libraries' code, shared by the ranks), and the
high-water mark over the end: a rank's memory by part, adding up to its peak above idle.
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

import node.compute.inner as inner_module
import node.compute.share as share_module
import protocol.runconfig as runconfig
from node.compute.group import Group
from node.compute.heap import return_large_blocks
from node.compute.model import PRESETS, ModelConfig, get_preset, model_shapes
from node.compute.sharding import balance
from node.compute.worker import Worker
from node.daemon.pending import Shard, save_applied, save_submitting
from node.research.bench.codec_bench import error_buffer
from node.research.bench.spawn import spawn
from node.research.report import publish
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
def registered(preset: str | None, ctx_len: int | None = None) -> Iterator[str]:
    """The model preset to build: ``preset`` (or ``SHAPE``), with another context length when
    ``ctx_len`` is given, registered under a temporary name for the length of a run."""
    base = SHAPE if preset is None else get_preset(preset)
    if preset is not None and ctx_len is None:
        yield preset
        return
    cfg = base if ctx_len is None else base.model_copy(update={"ctx_len": ctx_len})
    with _as_preset(SHAPE_NAME, cfg):
        yield SHAPE_NAME


@contextmanager
def _as_preset(name: str, cfg: ModelConfig) -> Iterator[None]:
    """``cfg`` known as model preset ``name`` while the block runs (``_register``)."""
    names: tuple[str, ...] = runconfig.MODEL_PRESETS
    _register(name, cfg)
    try:
        yield
    finally:
        runconfig.MODEL_PRESETS = names  # type: ignore[assignment]
        PRESETS.pop(name, None)


def _register(name: str, cfg: ModelConfig) -> None:
    """``cfg`` as model preset ``name``, for the node (``PRESETS``) and for the run config's
    check of model names (``protocol.runconfig.MODEL_PRESETS``)."""
    PRESETS[name] = cfg
    if name not in runconfig.MODEL_PRESETS:
        runconfig.MODEL_PRESETS = (*runconfig.MODEL_PRESETS, name)  # type: ignore[assignment]


@contextmanager
def _no_training() -> Iterator[None]:
    """Inner steps that take no time and leave θ as it is: only the round's other work is left."""
    real = inner_module.inner_step
    inner_module.inner_step = lambda *args, **kwargs: 0.0
    try:
        yield
    finally:
        inner_module.inner_step = real


def _status_mb() -> dict[str, float]:
    """This process's resident memory now (``rss``), the part of it that is pages of files
    (``file``: the libraries' code, which the ranks of a node share) and its high-water mark
    (``hwm``), in MB, from ``/proc/self/status``."""
    fields = {"VmRSS": "rss", "RssFile": "file", "VmHWM": "hwm"}
    out = dict.fromkeys(fields.values(), float("nan"))
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[fields[key]] = int(value.split()[0]) / 1024
    return out


def idle_status_mb() -> dict[str, float]:
    """``_status_mb`` of a fresh process that imported torch and the node."""
    code = (
        "import json, node.compute.worker, node.daemon.ops, torch\n"
        "from node.research.bench.node_work import _status_mb\n"
        "print(json.dumps(_status_mb()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    status: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return status


def idle_rss_mb() -> float:
    """Resident memory of a fresh process that imported torch and the node, in MB."""
    return idle_status_mb()["hwm"]


#: A rank's memory by part: the marks ``_rank_main`` takes, in order, and what each one adds
#: to the resident memory since the one before (the first: since an idle process).
STAGES = (
    ("joined", "the node's process group (gloo) and the bench's own imports"),
    ("dynamo", "torch._dynamo (the model's build on the meta device and AdamW import it)"),
    ("state", "θ, e and the model that trains (on several ranks: FSDP's chunks)"),
    ("adamw", "AdamW's moments"),
    ("first_step", "the first inner step: gradients, activations, FSDP's gathered blocks"),
    ("codec", "the pseudo-gradient and the codec (its compiled kernels loaded: numba, LLVM)"),
    ("round", "the rest of the first round: saves, the peers' payloads read and applied"),
    ("later", "the later rounds"),
)
#: The last part: the high-water mark over what the rank holds at its end.
PEAK = ("peak", "the peak over what is held at the end: one step's transient blocks")


class _Marks:
    """``_status_mb`` at each of ``STAGES``, on this rank (a stage marked once only)."""

    def __init__(self) -> None:
        self.status: dict[str, dict[str, float]] = {}

    def __call__(self, stage: str) -> None:
        if stage not in self.status:
            self.status[stage] = _status_mb()


def memory_parts(
    marks: dict[str, dict[str, float]], idle: dict[str, float]
) -> list[dict[str, Any]]:
    """Each part of ``STAGES`` (then ``PEAK``) with the resident MB it adds (``mb``) and the
    MB of those that are pages of files (``file_mb``): shared by the node's ranks, counted
    once in the machine's memory but in every rank's RSS. They add up to the rank's peak RSS
    above ``idle``."""
    parts, before = [], {"rss": idle["hwm"], "file": idle["file"]}  # (the bench's idle: its peak)
    for stage, what in STAGES:
        now = marks[stage]
        parts.append({
            "part": stage, "what": what,
            "mb": now["rss"] - before["rss"], "file_mb": now["file"] - before["file"],
        })  # fmt: skip
        before = now
    end = marks[STAGES[-1][0]]
    parts.append({"part": PEAK[0], "what": PEAK[1], "mb": end["hwm"] - end["rss"], "file_mb": 0.0})
    return parts


def _run_config(model: str, train_steps: int, batch_size: int) -> RunConfig:
    return RunConfig(
        name="bench", model=model, inner_steps=max(1, train_steps), batch_size=batch_size,
        rounds=1000, robust=True,
    )  # fmt: skip


def _make_worker(
    run: RunConfig, group: Group, seed: int, mark: Callable[[str], None] = lambda stage: None
) -> Worker:
    worker = Worker(run, run_id=run.run_id, node_id="node-0", slot=0, group=group)
    for name, e in worker.error.items():  # a realistic buffer for the codec
        e.copy_(error_buffer({name: tuple(e.shape)}, seed)[name])
    mark("state")
    # AdamW moments for every parameter (its FSDP chunk), as after any real step.
    for p in worker.placement.train_model.parameters():
        p.grad = torch.zeros_like(p)
    worker.opt.step()
    worker.opt.zero_grad(set_to_none=True)
    mark("adamw")
    return worker


class _Clock:
    """Each part's wall seconds on this rank after the ranks meet, and its CPU seconds (every
    thread of this process: numba's, the writes behind) as ``cpu_<part>``."""

    def __init__(self, group: Group, after: Callable[[str], None] | None = None) -> None:
        self.group = group
        self.after = after
        self.seconds: dict[str, float] = {}

    def __call__(self, part: str, fn: Callable[[], T]) -> T:
        self.group.barrier("starting a part")
        cpu, t0 = time.process_time(), time.perf_counter()
        out = fn()
        self.seconds[part] = time.perf_counter() - t0
        self.seconds[f"cpu_{part}"] = time.process_time() - cpu
        if self.after is not None:
            self.after(part)
        return out


def one_round(
    shard: Shard, peers: list[Path], after: Callable[[str], None] | None = None
) -> dict[str, float]:
    """Seconds of each part of one round on this rank (see the module docstring); ``after``
    is called with each part's name once it is done."""
    worker, group = shard.worker, shard.group
    clock = _Clock(group, after)
    r = worker.round
    result = clock("train_and_compress", worker.train_and_compress)
    seconds = clock.seconds
    seconds["inner_steps"] = result.inner_s
    seconds["bookkeeping"] = seconds["train_and_compress"] - result.encode_s - result.inner_s
    seconds["encode"] = result.encode_s
    mass: list[float | None] = [result.computed, result.scale, result.held]
    payload = result.payload if group.leader else None
    clock("save_trained", lambda: save_submitting(shard, r, mass, payload))
    clock("fingerprint", worker.fingerprint)
    payloads = clock("decode", lambda: {p.stem: worker.read(str(p)) for p in peers})
    clock("aggregate_apply", lambda: worker.apply(payloads))
    recon = worker.own_recon(r)
    clock("settle", lambda: (worker.sent_mass(recon), worker.held_mass()))
    worker.forget(r)
    clock("save_applied", lambda: save_applied(shard, trained=True))
    return seconds


def _rank_main(
    group: Group,
    out: Path,
    model: str,
    model_json: str,
    rounds: int,
    peers_dir: str,
    train_steps: int,
    batch_size: int,
    seed: int,
) -> None:
    """One rank of a benchmarked node: its samples, its peak RSS and what it holds."""
    if model not in PRESETS:  # a spawned process knows the shipped presets only
        _register(model, ModelConfig.model_validate_json(model_json))
    run = _run_config(model, train_steps, batch_size)
    peers = sorted(Path(peers_dir).glob("*.slc"))
    importlib.import_module("node.daemon.ops")  # a rank's imports are the idle process's
    mark = _Marks()
    mark("joined")
    importlib.import_module("torch._dynamo")  # its own part (building the worker imports it)
    mark("dynamo")
    with (
        _no_training() if train_steps == 0 else _nothing(),
        _counting() as hashed,
        _after_first_step(lambda: mark("first_step")),
    ):
        worker = _make_worker(run, group, seed, mark)
        shard = Shard(out / "state", group, worker)
        samples = []
        for r in range(rounds + 1):  # the first round loads the compiled codec: left out
            hashed.clear()
            cpu = time.process_time()
            seconds = one_round(shard, peers, _first_round(mark) if r == 0 else None)
            worker.writes.wait()
            seconds["cpu"] = time.process_time() - cpu
            seconds["fingerprints_of_theta"] = len(hashed)
            samples.append(seconds)
            mark("round")
    mark("later")
    total = sum(t.numel() for t in worker.params.values())
    chunks = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                 for p in worker.placement.train_model.parameters())  # fmt: skip
    every = sum(math.prod(shape) for shape in worker.shapes.values())
    report = {
        "rank": group.rank,
        "samples": samples,
        "peak_rss_mb": mark.status["later"]["hwm"],
        "marks": mark.status,
        "theta_share": total / every,
        "fsdp_share": chunks / every,
        "threads": torch.get_num_threads(),
    }
    (out / f"rank{group.rank}.json").write_text(json.dumps(report))


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _first_round(mark: _Marks) -> Callable[[str], None]:
    """The marks inside the first round, after its parts."""

    def after(part: str) -> None:
        if part == "train_and_compress":
            mark("first_step")  # (no inner step ran: nothing was marked)
            mark("codec")

    return after


@contextmanager
def _after_first_step(fn: Callable[[], None]) -> Iterator[None]:
    """``fn`` called once the first inner step (real or not) has returned."""
    real = inner_module.inner_step

    def step(*args: Any, **kwargs: Any) -> float:
        loss = real(*args, **kwargs)
        fn()
        return loss

    inner_module.inner_step = step
    try:
        yield
    finally:
        inner_module.inner_step = real


@contextmanager
def _counting() -> Iterator[list[int]]:
    """Every fingerprint of θ the worker computes, counted (one per round is the design)."""
    calls: list[int] = []
    plain, combined = share_module.fingerprint, share_module.node_fingerprint

    def count_plain(tensors: Any) -> str:
        calls.append(1)
        return plain(tensors)

    def count_combined(group: Group, tensors: Any) -> str:
        calls.append(1)
        return combined(group, tensors)

    share_module.fingerprint = count_plain
    share_module.node_fingerprint = count_combined
    try:
        yield calls
    finally:
        share_module.fingerprint = plain
        share_module.node_fingerprint = combined


def summarize(
    world: int,
    ranks: list[dict[str, Any]],
    params: int,
    idle_mb: float,
    idle: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One node's numbers: per part the slowest rank's median ns/param, each rank's CPU time,
    peak RSS above idle and share of the model; with ``idle`` (``idle_status_mb``), the
    largest rank's memory by part (``memory_parts``)."""

    def median(rank: dict[str, Any], part: str) -> float:
        return statistics.median(s[part] for s in rank["samples"][1:])

    ns = {p: 1e9 * max(median(r, p) for r in ranks) / params for p in PARTS}
    cpu_parts = ("train_and_compress", *PARTS[2:])
    cpu = {p: [1e9 * median(r, f"cpu_{p}") / params for r in ranks] for p in cpu_parts}
    return {
        "ranks": world,
        "ns_per_param": ns,
        "total_ns_per_param": sum(ns.values()),
        "cpu_ns_per_param_per_rank": [1e9 * median(r, "cpu") / params for r in ranks],
        #: Per part (bookkeeping and encode together: ``train_and_compress``), each rank's CPU.
        "cpu_ns_per_param_by_part": cpu,
        "inner_steps_s": max(median(r, "inner_steps") for r in ranks),
        "fingerprints_of_theta": max(median(r, "fingerprints_of_theta") for r in ranks),
        "peak_rss_above_idle_mb": [r["peak_rss_mb"] - idle_mb for r in ranks],
        "theta_share": [r["theta_share"] for r in ranks],
        "fsdp_share": [r["fsdp_share"] for r in ranks],
        "memory_parts": (
            memory_parts(max(ranks, key=lambda r: r["peak_rss_mb"])["marks"], idle)
            if idle is not None
            else None
        ),
        "samples": ranks,
    }


def run(
    *,
    preset: str | None = None,
    ranks: Sequence[int] = (1, 2, 4),
    rounds: int = 3,
    peers: int = 16,
    train_steps: int = 0,
    batch_size: int = 4,
    ctx_len: int | None = None,
    threads: int = 1,
    seed: int = 0,
    state_dir: str | None = None,
    json_out: str | None = None,
) -> dict[str, Any]:
    """Every rank count's node work; prints the tables and returns the numbers."""
    if batch_size < max(ranks):
        raise ValueError(f"--batch-size {batch_size} must be at least the largest rank count")
    return_large_blocks()  # the peers' buffers this process makes go back before the nodes run
    with registered(preset, ctx_len) as model, tempfile.TemporaryDirectory(dir=state_dir) as tmp:
        shapes = model_shapes(get_preset(model))
        params = sum(math.prod(s) for s in shapes.values())
        run_cfg = _run_config(model, train_steps, batch_size)
        peers_dir = Path(tmp) / "peers"
        peers_dir.mkdir()
        for i in range(peers):
            data, _ = encode(
                error_buffer(shapes, seed + 1 + i), topk=run_cfg.topk, tile=run_cfg.tile,
                run_id=run_cfg.run_id, round=0, node_id=f"peer-{i:02d}",
            )  # fmt: skip
            (peers_dir / f"peer-{i:02d}.slc").write_bytes(data)
        idle_status = idle_status_mb()
        idle = idle_status["hwm"]
        nodes = []
        for world in ranks:
            out = Path(tmp) / f"ranks-{world}"
            model_json = get_preset(model).model_dump_json()
            args = (model, model_json, rounds, str(peers_dir), train_steps, batch_size, seed)
            # One rank: a plain process (``sparseloco node``); more: what torchrun starts.
            codes = spawn(world, _rank_main, out, *args, threads=threads, plain=world == 1)
            if codes != [0] * world:
                raise RuntimeError(f"the {world}-rank node failed: exit codes {codes}")
            reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
            nodes.append(summarize(world, reports, params, idle, idle_status))
    report = {
        "params": params,
        "peers": peers,
        "rounds": rounds,
        "train_steps": train_steps,
        "threads_per_rank": threads,
        "idle_rss_mb": idle,
        "balance": {str(w): balance(shapes, w).over_ideal for w in ranks},
        "nodes": nodes,
    }
    publish(markdown(report), report, json_out)
    return report


#: Rows of the table that show each node's busiest or largest rank: label, key, digits.
_BUSIEST_ROWS = (
    ("CPU time of the busiest rank (writes behind too)", "cpu_ns_per_param_per_rank", 1),
    ("peak RSS above idle, largest rank (MB)", "peak_rss_above_idle_mb", 0),
    ("largest rank's share of θ and e", "theta_share", 3),
    ("largest rank's FSDP chunk (params, AdamW)", "fsdp_share", 3),
)


def markdown(report: dict[str, Any]) -> str:
    """Per part, ns/param on the node's path for each rank count; then memory and shares."""
    nodes = report["nodes"]
    head = ["| part | " + " | ".join(f"{n['ranks']} rank(s)" for n in nodes) + " |"]
    head.append("|---|" + "---:|" * len(nodes))
    rows = []
    for part in PARTS:
        cells = " | ".join(f"{n['ns_per_param'][part]:.1f}" for n in nodes)
        rows.append(f"| {part.replace('_', ' ')} | {cells} |")
    cells = " | ".join(f"**{n['total_ns_per_param']:.1f}**" for n in nodes)
    rows.append(f"| **total on the node's path** | {cells} |")
    for label, key, digits in _BUSIEST_ROWS:
        cells = " | ".join(f"{max(n[key]):.{digits}f}" for n in nodes)
        rows.append(f"| {label} | {cells} |")
    rows += ["", "CPU ns/param of each part, busiest rank (every thread of its process):", ""]
    rows += head
    for part in nodes[0]["cpu_ns_per_param_by_part"]:
        cells = " | ".join(f"{max(n['cpu_ns_per_param_by_part'][part]):.1f}" for n in nodes)
        rows.append(f"| {part.replace('_', ' ')} | {cells} |")
    rows += ["", "A rank's memory by part (the largest rank), MB of RSS (of which file pages):", ""]
    rows += head
    rows += _memory_rows(nodes)
    title = (
        f"{report['params'] / 1e6:.1f} M parameters, {report['peers']} peers, median of"
        f" {report['rounds']} rounds, {report['threads_per_rank']} torch thread(s) per rank,"
        f" inner steps: {report['train_steps'] or 'none'};"
        f" idle process {report['idle_rss_mb']:.0f} MB"
    )
    return "\n".join([title, "", *head, *rows])


def _memory_rows(nodes: list[dict[str, Any]]) -> list[str]:
    """``memory_parts`` of every node side by side, then their sum: the peak above idle."""
    if any(n.get("memory_parts") is None for n in nodes):
        return []
    rows = []
    for i, (_, what) in enumerate((*STAGES, PEAK)):
        cells = " | ".join(
            f"{n['memory_parts'][i]['mb']:.0f} ({n['memory_parts'][i]['file_mb']:.0f})"
            for n in nodes
        )
        rows.append(f"| {what} | {cells} |")
    cells = " | ".join(
        f"**{sum(p['mb'] for p in n['memory_parts']):.0f}**"
        f" ({sum(p['file_mb'] for p in n['memory_parts']):.0f})"
        for n in nodes
    )
    rows.append(f"| **peak RSS above idle** | {cells} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m node.research.bench.node_work``: ``sparseloco bench node-work`` on its own."""
    from node.research.bench.cli import bench_main

    return bench_main("node-work", "python -m node.research.bench.node_work", __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
