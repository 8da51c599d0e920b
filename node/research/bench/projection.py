"""``sparseloco bench project``: round time and utilisation at 1 B-70 B, from measured costs.

Arithmetic only (issue 11, benchmark 5): nothing is run. Every term but the link's round trips
is linear in the parameter count N, so on a link without delay utilisation depends on the link,
the batch and the per-parameter costs, not on N. Per node and round, on a link of ``up`` and
``down`` bit/s (``--links``: the same rate both ways) and round trip ``RTT``:

    train    = 6 · N · tokens_per_step · H / (gpus · peak_flops · mfu)
    up       = bits_per_param · N / up                (one payload)
    down     = G · bits_per_param · N / down          (G peers' payloads, after the manifest)
    link     = requests + slow start + resets         (``node.research.bench.wire``; 0 at RTT 0)
    work     = work_ns · 1e-9 · N                     (encode, checks, aggregate+apply, saves)
    round    = train + work + up + down + link                                     (no overlap)
    round_ov = max(train, up + down + requests + slow start − RTT + resets) + 2 RTT + path work
    util     = train / round

``link``: ``6 + ⌈G / parallel_downloads⌉`` round trips the round waits for (requests to the
coordinator, the PUT, the GETs' waves), TCP slow start from an idle connection for the PUT and
for the GETs, and on a link that resets, the expected retries (issue 20; docs/benchmarks.md §17
measures them against the WAN lab). With overlap (docs/benchmarks.md §12: round r's aggregate
applied one round late) the transfers run while the next round trains, and so can the payload
checks (they need only the bytes); the rest of the work touches θ or the error buffer and stays
between two trainings, with two round trips (the loop's round view, the report), which leave
the transfers' chain one round trip shorter than plain's (the report) and one longer (the round
view of the payload's round): ``comm − RTT`` beside training. Waits for a slower peer and the
coordinator's close are left out (tens of ms, docs/benchmarks.md §4).

Dense comparisons (their own work taken as 0): DiLoCo with an fp32 pseudo-gradient over a ring
all-reduce among the G nodes (each node sends and receives 2(G−1)/G of it, concurrently, in
2(G−1) steps of a round trip each), DiLoCo with a bf16 pseudo-gradient through the store (as
SparseLoCo: one up, G down), and DDP with a bf16 gradient ring all-reduce after every inner step
(overlap: max(step, exchange) per step).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from node.research.bench.wire import (
    OVERLAP_BESIDE_RTTS,
    OVERLAP_PATH_RTTS,
    PARALLEL_DOWNLOADS,
    PLAIN_REQUEST_RTTS,
    Link,
    WireTimes,
    bytes_s,
    lab_links,
    reset_s,
    store_round,
)

Method = Literal[
    "sparseloco, CPU work",
    "sparseloco, device work (assumed)",
    "sparseloco, CPU work sharded over the ranks",
    "DiLoCo fp32, ring all-reduce",
    "DiLoCo bf16, via the store",
    "DDP bf16, all-reduce per step",
]
Positive = Annotated[float, Field(gt=0.0)]
#: docs/benchmarks.md §15's fit of the busiest rank's CPU ns/param at 81 M (1, 2 and 4 ranks).
SHARD_FIXED_NS = 4.3
SHARD_SCALED_NS = 22.1


class Assumptions(BaseModel):
    """Every input of the projection; the defaults are the measured numbers and the issue's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    #: Model sizes projected (parameters).
    sizes: tuple[Positive, ...] = Field((1e9, 8e9, 70e9), min_length=1)
    #: Link rates projected, Mbit/s, each direction (issue 11, benchmark 5: 100 Mbit/s, 1 Gbit/s).
    links_mbit: tuple[Positive, ...] = Field((100.0, 1000.0))
    #: WAN lab profiles projected besides (``--link home,far``: rates, RTT and resets).
    profiles: tuple[str, ...] = ()
    #: Parallel GETs of a node (``NodeSettings.parallel_downloads``): ⌈G / this⌉ waves.
    parallel_downloads: int = Field(PARALLEL_DOWNLOADS, ge=1)
    #: Bytes a reset makes a transfer send again at most; None: as the node does (objects of
    #: 64 MiB or more in 8 MiB parts and resumed ranges, smaller ones whole: ``wire.reset_s``).
    resume_bytes: float | None = Field(None, gt=0.0)
    #: G: payloads downloaded per round (issue 11's assumption).
    peers: int = Field(16, ge=1)
    #: H: inner steps per round (issue 11's assumption; docs/benchmarks.md §3 runs H=30 too).
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
    #: Payload size, bits/param: docs/benchmarks.md §1, our format, EF-like input, k=64.
    bits_per_param: float = Field(0.1445, gt=0.0)
    #: The node's own work on the round's path, ns/param, on the 2-core CPU: docs/benchmarks.md
    #: §10, 81 M, the rerun on a quiet machine (bookkeeping 0.6 + encode 4.9 + save 7.1 +
    #: fingerprint 0 + decode 3.6 + aggregate+apply 9.7 + settle 1.7 + after applying 0.9).
    cpu_work_ns: float = Field(28.5, ge=0.0)
    #: Of that, the payload checks (docs/benchmarks.md §10, the rerun's decode row), which can run
    #: while the next round trains when transfers overlap.
    cpu_overlappable_ns: float = Field(3.6, ge=0.0)
    #: ASSUMPTION, not measured (``tests/bench/gpu_check.py`` has not run on a GPU): the node's
    #: work with the device path (docs/benchmarks.md §9, "The device path"), ns/param: host checks
    #: of the Rice streams 2.4 (docs/benchmarks.md §9: about 0.2 s for 16 peers at 82.6 M, this
    #: CPU) + the fsynced commit write of e, 4 B/param, at 2 GB/s NVMe 2.0 + the device codec
    #: and apply, about 100 B/param of HBM traffic at 3.35 TB/s with a 15x allowance, 0.5.
    device_work_ns: float = Field(5.0, ge=0.0)
    #: Of that, the host checks (docs/benchmarks.md §9), overlappable as on the CPU path.
    device_overlappable_ns: float = Field(2.4, ge=0.0)
    #: A node of ``gpus`` ranks, each with CPU cores of its own (docs/benchmarks.md §15, the
    #: busiest rank's CPU time per round at 81 M on 1, 2 and 4 ranks, fitted as
    #: ``fixed + sharded / ranks``): the part that does not shrink with the rank count
    #: (rank 0 assembling and hashing the payload, the exchanges between ranks) ...
    shard_fixed_ns: float = Field(SHARD_FIXED_NS, ge=0.0)
    #: ... and the part each rank does for its own tensors only (codec, aggregation, saves).
    shard_scaled_ns: float = Field(SHARD_SCALED_NS, ge=0.0)

    @model_validator(mode="after")
    def _some_link(self) -> Assumptions:
        if not self.links_mbit and not self.profiles:
            raise ValueError("no link to project: give --links rates or --link profiles")
        return self


class Row(BaseModel):
    """One model size, link and method: seconds per round and the share spent training."""

    model_config = ConfigDict(frozen=True)

    params: float
    link: Link
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
    #: What the link adds besides bytes / rate: round trips, slow start, resets (0 at RTT 0).
    requests_s: float = 0.0
    slow_start_s: float = 0.0
    resets_s: float = 0.0
    round_s: float
    round_overlap_s: float

    @property
    def link_mbit(self) -> float:
        """The upload rate (the rate of a ``--links`` link, the same both ways)."""
        return self.link.up_mbit

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
    return bytes_s(nbytes, link_mbit)


def on_link(
    link: Link,
    *,
    train_s: float,
    work_s: float,
    path_s: float,
    payload: float,
    peers: int,
    parallel: int = PARALLEL_DOWNLOADS,
    resume_bytes: float | None = None,
    nodes: int | None = None,
) -> tuple[WireTimes, float, float]:
    """One node's round through the store on ``link``: the wire's terms, the round plain and
    the round overlapped (module docstring). ``path_s`` is the work that stays between two
    trainings under overlap. ``bench wan`` calls this with measured inputs."""
    wire = store_round(link, payload, peers, parallel)
    plain = train_s + work_s + wire.comm_s
    resets = reset_s(link, wire, plain, payload, resume_bytes, peers if nodes is None else nodes)
    # Overlapped, the report leaves the transfers' chain for the path between two trainings,
    # and the loop's round view joins it there (``wire``'s docstring).
    # A reset delays what is in flight, which under overlap is the transfers' chain beside
    # training: its cost shows only where that chain is the longer branch.
    beside = wire.comm_s - (PLAIN_REQUEST_RTTS - OVERLAP_BESIDE_RTTS) * link.rtt_s
    overlap = max(train_s, beside + resets) + OVERLAP_PATH_RTTS * link.rtt_s + path_s
    return wire.model_copy(update={"reset_cost_s": resets}), plain + resets, overlap


def sharded_work_ns(a: Assumptions) -> float:
    """The node's own work per parameter on the busiest of its ``gpus`` ranks (CPU path)."""
    return a.shard_fixed_ns + a.shard_scaled_ns / a.gpus


def _sparse(a: Assumptions, n: float, link: Link, kind: str) -> Row:
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
    return _store_row(a, n, link, method, a.bits_per_param * n / 8.0, work_ns, free_ns)


def _store_row(
    a: Assumptions,
    n: float,
    link: Link,
    method: Method,
    payload: float,
    work_ns: float = 0.0,
    free_ns: float = 0.0,
) -> Row:
    """One payload up and G down through the store, with the node's work around them."""
    train = train_seconds(a, n)
    wire, plain, overlap = on_link(
        link,
        train_s=train,
        work_s=work_ns * 1e-9 * n,
        path_s=max(work_ns - free_ns, 0.0) * 1e-9 * n,
        payload=payload,
        peers=a.peers,
        parallel=a.parallel_downloads,
        resume_bytes=a.resume_bytes,
    )
    return Row(
        params=n,
        link=link,
        method=method,
        bytes_moved=(1 + a.peers) * payload,
        train_s=train,
        up_s=wire.up_s,
        down_s=wire.down_s,
        comm_s=wire.comm_s,
        work_s=work_ns * 1e-9 * n,
        requests_s=wire.requests_s,
        slow_start_s=wire.slow_start_s,
        resets_s=wire.reset_cost_s,
        round_s=plain,
        round_overlap_s=overlap,
    )


def _ring(a: Assumptions, n: float, link: Link, method: Method) -> Row:
    """A ring all-reduce: each node sends and receives 2(G-1)/G of the buffer, concurrently,
    in 2(G-1) steps of a round trip each; once a round (DiLoCo) or every inner step (DDP)."""
    fp32 = method == "DiLoCo fp32, ring all-reduce"
    times = 1 if fp32 else a.inner_steps
    each_way = times * 2.0 * (a.peers - 1) / a.peers * (4.0 if fp32 else 2.0) * n
    up, down = bytes_s(each_way, link.up_mbit), bytes_s(each_way, link.down_mbit)
    hops = times * 2.0 * (a.peers - 1) * link.rtt_s
    comm = max(up, down) + hops
    train = train_seconds(a, n)
    return Row(
        params=n,
        link=link,
        method=method,
        bytes_moved=2.0 * each_way,
        train_s=train,
        up_s=up,
        down_s=down,
        comm_s=comm,
        work_s=0.0,
        requests_s=hops,
        round_s=train + comm,
        round_overlap_s=max(train, comm),
    )


def links_of(a: Assumptions) -> list[Link]:
    """The links projected: ``--links`` rates, then ``--link`` lab profiles by name."""
    named = lab_links() if a.profiles else {}
    unknown = [name for name in a.profiles if name not in named]
    if unknown:
        raise ValueError(f"unknown link {unknown[0]!r}; choose from {', '.join(named)}")
    return [Link.symmetric(m) for m in a.links_mbit] + [named[name] for name in a.profiles]


def project(a: Assumptions | None = None, links: list[Link] | None = None) -> list[Row]:
    """Every (size, link, method) row: SparseLoCo three times (one CPU process, the CPU work
    sharded over the node's ranks, device work), then the dense ones. ``links`` replaces the
    links the assumptions name."""
    a = a or Assumptions()
    rows: list[Row] = []
    for n in a.sizes:
        for link in links if links is not None else links_of(a):
            rows += [_sparse(a, n, link, kind) for kind in ("cpu", "sharded", "device")]
            rows.append(_ring(a, n, link, "DiLoCo fp32, ring all-reduce"))
            rows.append(_store_row(a, n, link, "DiLoCo bf16, via the store", 2.0 * n))
            rows.append(_ring(a, n, link, "DDP bf16, all-reduce per step"))
    return rows
