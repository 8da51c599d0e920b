"""``sparseloco bench project``: round time and utilisation at 1 B-70 B, from measured costs.

Arithmetic only (issue 11, benchmark 5): nothing is run. Every term is linear in the parameter
count N, so utilisation depends on the link, the batch and the per-parameter costs, not on N.
Per node and round (a link of ``r`` bit/s, full duplex, the same rate both ways):

    train    = 6 · N · tokens_per_step · H / (gpus · peak_flops · mfu)
    up       = bits_per_param · N / r                 (one payload)
    down     = G · bits_per_param · N / r             (G peers' payloads, after the manifest)
    work     = work_ns · 1e-9 · N                     (encode, checks, aggregate+apply, saves)
    round    = train + work + up + down                                   (no overlap)
    round_ov = max(train, up + down) + (work − overlappable_ns · 1e-9 · N) (overlap)
    util     = train / round

With overlap (README benchmark 12: round r's aggregate applied one round late) the transfers run
while the next round trains, and so can the payload checks (they need only the bytes); the rest
of the work touches θ or the error buffer and stays between two trainings. Waits for a slower
peer, the coordinator's close and request latencies are left out (tens of ms, README benchmark 4).

Dense comparisons (their own work taken as 0): DiLoCo with an fp32 pseudo-gradient over a ring
all-reduce among the G nodes (each node sends and receives 2(G−1)/G of it, concurrently),
DiLoCo with a bf16 pseudo-gradient through the store (as SparseLoCo: one up, G down), and DDP
with a bf16 gradient ring all-reduce after every inner step (overlap: max(step, exchange) per step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.errors import ConfigError, Problem, config_error

Method = Literal[
    "sparseloco, CPU work",
    "sparseloco, device work (assumed)",
    "sparseloco, CPU work sharded over the ranks",
    "DiLoCo fp32, ring all-reduce",
    "DiLoCo bf16, via the store",
    "DDP bf16, all-reduce per step",
]
Positive = Annotated[float, Field(gt=0.0)]
#: README benchmark 15's fit of the busiest rank's CPU ns/param at 81 M (1, 2 and 4 ranks).
SHARD_FIXED_NS = 4.3
SHARD_SCALED_NS = 22.1


class Assumptions(BaseModel):
    """Every input of the projection; the defaults are the measured numbers and the issue's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Model sizes projected (parameters).
    sizes: tuple[Positive, ...] = Field((1e9, 8e9, 70e9), min_length=1)
    #: Link rates projected, Mbit/s, each direction (issue 11, benchmark 5: 100 Mbit/s, 1 Gbit/s).
    links_mbit: tuple[Positive, ...] = Field((100.0, 1000.0), min_length=1)
    #: G: payloads downloaded per round (issue 11's assumption).
    peers: int = Field(16, ge=1)
    #: H: inner steps per round (issue 11's assumption; README benchmark 3 runs H=30 too).
    inner_steps: int = Field(30, ge=1)
    #: GPUs per node (issue 11's assumption).
    gpus: int = Field(8, ge=1)
    #: Model FLOPs utilisation of training (issue 11's assumption).
    mfu: float = Field(0.40, gt=0.0, le=1.0)
    #: Peak FLOP/s of one GPU: H100 SXM, bf16 dense, 989 TFLOP/s (vendor datasheet; chosen here).
    peak_flops: float = Field(989e12, gt=0.0)
    #: Tokens per inner step per node: 8 GPUs × 16 sequences × 2,048 tokens (chosen here; over
    #: G=16 nodes a 4.2 M-token global batch, the size of large open pre-training runs').
    tokens_per_step: int = Field(8 * 16 * 2048, ge=1)
    #: Payload size, bits/param: README benchmark 1, our format, EF-like input, k=64.
    bits_per_param: float = Field(0.1445, gt=0.0)
    #: The node's own work on the round's path, ns/param, on the 2-core CPU: README benchmark 10,
    #: 81 M, the rerun on a quiet machine (bookkeeping 0.6 + encode 4.9 + save 7.1 + fingerprint
    #: 0 + decode 3.6 + aggregate+apply 9.7 + settle 1.7 + after applying 0.9).
    cpu_work_ns: float = Field(28.5, ge=0.0)
    #: Of that, the payload checks (README benchmark 10, the rerun's decode row), which can run
    #: while the next round trains when transfers overlap.
    cpu_overlappable_ns: float = Field(3.6, ge=0.0)
    #: ASSUMPTION, not measured (``tests/bench/gpu_check.py`` has not run on a GPU): the node's
    #: work with the device path (README benchmark 9, "The device path"), ns/param: host checks
    #: of the Rice streams 2.4 (README benchmark 9: about 0.2 s for 16 peers at 82.6 M, this
    #: CPU) + the fsynced commit write of e, 4 B/param, at 2 GB/s NVMe 2.0 + the device codec
    #: and apply, about 100 B/param of HBM traffic at 3.35 TB/s with a 15x allowance, 0.5.
    device_work_ns: float = Field(5.0, ge=0.0)
    #: Of that, the host checks (README benchmark 9), overlappable as on the CPU path.
    device_overlappable_ns: float = Field(2.4, ge=0.0)
    #: A node of ``gpus`` ranks, each with CPU cores of its own (README benchmark 15, the
    #: busiest rank's CPU time per round at 81 M on 1, 2 and 4 ranks, fitted as
    #: ``fixed + sharded / ranks``): the part that does not shrink with the rank count
    #: (rank 0 assembling and hashing the payload, the exchanges between ranks) ...
    shard_fixed_ns: float = Field(SHARD_FIXED_NS, ge=0.0)
    #: ... and the part each rank does for its own tensors only (codec, aggregation, saves).
    shard_scaled_ns: float = Field(SHARD_SCALED_NS, ge=0.0)


class Row(BaseModel):
    """One model size, link and method: seconds per round and the share spent training."""

    model_config = ConfigDict(frozen=True)

    params: float
    link_mbit: float
    method: Method
    #: Bytes this node sends plus receives per round.
    bytes_moved: float
    train_s: float
    #: Sending time (SparseLoCo, DiLoCo via the store) or one direction of the all-reduce.
    up_s: float
    down_s: float
    #: Time on the wire per round: up + down through the store, one direction for all-reduce.
    comm_s: float
    work_s: float
    round_s: float
    round_overlap_s: float

    @property
    def util(self) -> float:
        """Training's share of a round without overlap."""
        return self.train_s / self.round_s

    @property
    def util_overlap(self) -> float:
        """Training's share of a round with communication overlapped."""
        return self.train_s / self.round_overlap_s


def train_seconds(a: Assumptions, params: float) -> float:
    """H inner steps of 6·N FLOPs per token on ``gpus`` GPUs at ``mfu`` of peak."""
    return 6.0 * params * a.tokens_per_step * a.inner_steps / (a.gpus * a.peak_flops * a.mfu)


def wire_seconds(nbytes: float, link_mbit: float) -> float:
    """Time to move ``nbytes`` over a link of ``link_mbit`` Mbit/s."""
    return nbytes * 8.0 / (link_mbit * 1e6)


def _row(
    a: Assumptions, n: float, link: float, method: Method, sent: float, received: float, **kw: float
) -> Row:
    """A row from the bytes on the wire; ``comm_s``, ``work_s`` and ``path_s`` may be given."""
    train = train_seconds(a, n)
    up, down = wire_seconds(sent, link), wire_seconds(received, link)
    comm, work = kw.get("comm_s", up + down), kw.get("work_s", 0.0)
    return Row(
        params=n,
        link_mbit=link,
        method=method,
        bytes_moved=sent + received,
        train_s=train,
        up_s=up,
        down_s=down,
        comm_s=comm,
        work_s=work,
        round_s=train + work + comm,
        round_overlap_s=max(train, comm) + kw.get("path_s", work),
    )


def sharded_work_ns(a: Assumptions) -> float:
    """The node's own work per parameter on the busiest of its ``gpus`` ranks (CPU path)."""
    return a.shard_fixed_ns + a.shard_scaled_ns / a.gpus


def _sparse(a: Assumptions, n: float, link: float, kind: str) -> Row:
    payload = a.bits_per_param * n / 8.0
    method: Method
    if kind == "device":
        work_ns, free_ns = a.device_work_ns, a.device_overlappable_ns
        method = "sparseloco, device work (assumed)"
    elif kind == "sharded":
        work_ns = sharded_work_ns(a)
        free_ns = a.cpu_overlappable_ns * work_ns / max(a.cpu_work_ns, 1e-12)
        method = "sparseloco, CPU work sharded over the ranks"
    else:
        work_ns, free_ns = a.cpu_work_ns, a.cpu_overlappable_ns
        method = "sparseloco, CPU work"
    return _row(
        a,
        n,
        link,
        method,
        payload,
        a.peers * payload,
        work_s=work_ns * 1e-9 * n,
        path_s=max(work_ns - free_ns, 0.0) * 1e-9 * n,
    )


def _dense(a: Assumptions, n: float, link: float, method: Method) -> Row:
    if method == "DiLoCo bf16, via the store":
        return _row(a, n, link, method, 2.0 * n, a.peers * 2.0 * n)
    # A ring all-reduce: each node sends and receives 2(G-1)/G of the buffer, concurrently.
    fp32 = method == "DiLoCo fp32, ring all-reduce"
    times = 1 if fp32 else a.inner_steps
    each_way = times * 2.0 * (a.peers - 1) / a.peers * (4.0 if fp32 else 2.0) * n
    return _row(a, n, link, method, each_way, each_way, comm_s=wire_seconds(each_way, link))


def project(a: Assumptions | None = None) -> list[Row]:
    """Every (size, link, method) row: SparseLoCo three times (one CPU process, the CPU work
    sharded over the node's ranks, device work), then the dense ones."""
    a = a or Assumptions()
    rows: list[Row] = []
    for n in a.sizes:
        for link in a.links_mbit:
            rows += [_sparse(a, n, link, kind) for kind in ("cpu", "sharded", "device")]
            rows += [_dense(a, n, link, m) for m in get_args(Method)[3:]]
    return rows


def _size(n: float) -> str:
    return f"{n / 1e9:g} B"


def _link(mbit: float) -> str:
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def markdown(a: Assumptions, rows: list[Row]) -> str:
    """The SparseLoCo table, then the comparison with dense DiLoCo and DDP."""
    out = [
        f"G={a.peers}, H={a.inner_steps}, {a.gpus} GPUs x {a.peak_flops / 1e12:g} TFLOP/s at"
        f" {a.mfu:.0%} MFU, {a.tokens_per_step:,} tokens per inner step per node,"
        f" {a.bits_per_param} bits/param",
        "",
        "| model | link | node work | train s | up s | down s | work s | round s | util"
        " | round s, overlap | util, overlap |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.method.startswith("sparseloco"):
            kind = (
                "device (assumed)"
                if "device" in r.method
                else f"CPU, {a.gpus} ranks"
                if "sharded" in r.method
                else "CPU, one process"
            )
            out.append(
                f"| {_size(r.params)} | {_link(r.link_mbit)} | {kind} | {r.train_s:,.1f}"
                f" | {r.up_s:,.2f} | {r.down_s:,.1f} | {r.work_s:,.1f} | {r.round_s:,.1f}"
                f" | {r.util:.1%} | {r.round_overlap_s:,.1f} | {r.util_overlap:.1%} |"
            )
    out += [
        "",
        "| model | link | method | GB moved per node and round | comm s | round s | util"
        " | round s, overlap | util, overlap |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if not r.method.startswith("sparseloco, CPU work"):
            out.append(
                f"| {_size(r.params)} | {_link(r.link_mbit)} | {r.method}"
                f" | {r.bytes_moved / 1e9:,.2f} | {r.comm_s:,.1f} | {r.round_s:,.1f} | {r.util:.1%}"
                f" | {r.round_overlap_s:,.1f} | {r.util_overlap:.1%} |"
            )
    return "\n".join(out) + "\n"


def add_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The command's flags (defaults: ``Assumptions``); ``p`` is returned for chaining."""
    p.add_argument("--sizes", help="parameter counts, comma-separated: 1B,8B,70B or 1e9,...")
    p.add_argument("--links", help="link rates in Mbit/s, comma-separated (default 100,1000)")
    p.add_argument("--mfu", type=float, help="model FLOPs utilisation (default 0.4)")
    p.add_argument("--gpus", type=int, help="GPUs per node (default 8)")
    p.add_argument("--peak-tflops", type=float, help="one GPU's peak (default 989, H100 bf16)")
    p.add_argument("--tokens-per-step", type=int, help="per node (default 262144)")
    p.add_argument("--inner-steps", "-H", type=int, help="H (default 30)")
    p.add_argument("--peers", "-G", type=int, help="G, payloads gathered (default 16)")
    p.add_argument("--bits-per-param", type=float, help="payload size (default 0.1445)")
    p.add_argument("--cpu-work-ns", type=float, help="node work, CPU path (default 28.5)")
    p.add_argument("--device-work-ns", type=float, help="device path (assumed 5.0)")
    p.add_argument(
        "--shard-fixed-ns", type=float, help="per-rank work that does not shrink with ranks"
    )
    p.add_argument("--shard-scaled-ns", type=float, help="per-rank work divided by the ranks")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write inputs and rows here")
    return p


def _count(word: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get(word[-1:].upper(), 1.0)
    return float(word[:-1] if scale != 1.0 else word) * scale


#: Fields whose flag is not the field's name with dashes.
_FLAGS = {"links_mbit": "--links", "peak_flops": "--peak-tflops"}


def _flag(problem: Problem) -> str:
    field = str(problem.loc[0]) if problem.loc else ""
    return f"{_FLAGS.get(field, '--' + field.replace('_', '-'))}: {problem.message}"


def assumptions_from(args: argparse.Namespace) -> Assumptions:
    """The flags given, over the defaults; a bad value raises ``ConfigError`` naming its flag."""
    fields = Assumptions.model_fields
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    for flag, field, parse in (("sizes", "sizes", _count), ("links", "links_mbit", float)):
        text = getattr(args, flag)
        if text is not None:
            try:
                given[field] = tuple(parse(w.strip()) for w in text.split(",") if w.strip())
            except ValueError as exc:
                raise ConfigError(f"--{flag}: not a list of numbers: {text!r}") from exc
    if args.peak_tflops is not None:
        given["peak_flops"] = args.peak_tflops * 1e12
    try:
        return Assumptions(**given)
    except ValidationError as exc:
        raise config_error(exc, _flag) from exc


def run(args: argparse.Namespace) -> int:
    """Print the tables; with ``--json``, write the inputs and every row too."""
    a = assumptions_from(args)
    rows = project(a)
    print(markdown(a, rows), end="")
    if args.json_out:
        report = {
            "assumptions": a.model_dump(),
            "rows": [
                r.model_dump() | {"util": r.util, "util_overlap": r.util_overlap} for r in rows
            ],
        }
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    return 0
