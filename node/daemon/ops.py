"""The round's compute as named steps that every process of a node takes together.

The daemon (rank 0) decides *what* happens; the compute it needs is one of the ops below, run on
its compute thread. On a node of several processes rank 0 first sends the op's name and its
small arguments over the command channel (``Group.send_op``), and every other rank runs the same
op on its own share (``node.daemon.ranks.follow``): the ops call collectives in the same order on
every rank, so they meet. What only rank 0 has (the payload bytes it assembled, the data stream
it fetches) goes in keyword arguments, which are not sent.

Every op is a function of a ``RankContext``; the arguments sent are msgpack-able values: round
numbers, flags, node ids, local file paths. Bulk data never travels here: a peer's payload or a
checkpoint reaches the other ranks as a file rank 0 downloaded into the state dir, which each
rank reads its own tensors of.

Failures that every rank meets alike (a stop, a non-finite loss, a payload or checkpoint that
fails validation, a state that cannot be read) are agreed inside the op and raised on every
rank; rank 0's daemon handles them and the followers carry on with the next op. Anything else
on a follower ends that process, which fails rank 0's next collective: the node stops and is
restarted from its state.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from node.compute.checkpoint import load_checkpoint_file, write_checkpoint_file
from node.compute.data import Corpus
from node.compute.group import Group
from node.compute.shards import check_payload_header
from node.compute.worker import TrainResult, Worker
from node.daemon import pending as saves
from node.daemon.dataset import follower_stream
from node.daemon.merge import Handoff
from node.daemon.pending import PendingRound, Shard
from node.daemon.settings import NodeSettings
from node.errors import Abandoned, RanksError
from protocol.errors import PayloadError
from protocol.messages import JoinResponse

T = TypeVar("T")

#: Ops by name (``op`` registers them).
OPS: dict[str, Callable[..., Any]] = {}


def op(fn: Callable[..., T]) -> Callable[..., T]:
    OPS[fn.__name__] = fn
    return fn


@dataclass
class RankContext:
    """What one process of a node keeps between ops."""

    settings: NodeSettings
    group: Group
    shard: Shard | None = None
    #: A stop request this process received (a follower's SIGTERM).
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def worker(self) -> Worker:
        if self.shard is None:
            raise RuntimeError("the node's compute is not set up yet")
        return self.shard.worker


class NodeCompute:
    """Rank 0's door to the node's compute: ``await node("op", *args, **local)``."""

    def __init__(self, ctx: RankContext, executor: ThreadPoolExecutor) -> None:
        self.ctx = ctx
        self.executor = executor

    async def __call__(self, name: str, *args: Any, **local: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.executor, functools.partial(self.run, name, args, local)
        )

    def run(self, name: str, args: tuple[Any, ...], local: dict[str, Any]) -> Any:
        """(compute thread) Tell the other ranks, then take the op's share here."""
        if name not in OPS:
            raise RanksError(f"no op {name!r}")
        self.ctx.group.send_op(name, args)
        return OPS[name](self.ctx, *args, **local)


# -- setting up and saving ---------------------------------------------------------------------


@op
def setup(
    ctx: RankContext, joined_json: str, dataset_root: str | None, *, data: Corpus | None = None
) -> tuple[PendingRound | None, bool]:
    """Build this rank's worker for the run the node joined and load its share of the state:
    the pending round (rank 0) and whether state was restored. ``data``: rank 0's stream of
    the run's dataset; the other ranks read the same folder (``dataset_root``)."""

    from node.compute.bands import limit_threads

    s = ctx.settings
    joined = JoinResponse.model_validate_json(joined_json)
    if s.threads:
        limit_threads(s.threads)
    if data is None and dataset_root is not None:
        data = follower_stream(Path(dataset_root), joined.run, ctx.stop)
    worker = Worker(
        joined.run,
        run_id=joined.run_id,
        node_id=joined.node_id,
        slot=joined.slot,
        data=s.data if data is None else data,
        eval_batches=s.eval_batches,
        eval_batch_size=s.eval_batch_size,
        device=s.device,
        group=ctx.group,
    )
    ctx.shard = Shard(s.state_dir, ctx.group, worker)
    return saves.restore_state(ctx.shard)


@op
def save_idle(ctx: RankContext) -> str:
    """θ, e and AdamW to disk with nothing pending; θ's fingerprint."""
    if ctx.shard is None:
        raise RuntimeError("the node's compute is not set up yet")
    return saves.save_idle(ctx.shard)


@op
def save_trained(
    ctx: RankContext, round_: int, mass: list[float | None] | None, *, payload: bytes | None = None
) -> float:
    """The state after training round ``round_`` (``pending.save_submitting``); its seconds."""
    if ctx.shard is None:
        raise RuntimeError("the node's compute is not set up yet")
    return saves.save_submitting(ctx.shard, round_, mass, payload)


# -- a round -----------------------------------------------------------------------------------


@op
def train(
    ctx: RankContext,
    round_: int | None,
    eager_from: int | None,
    merging: bool = False,
    *,
    merge: Handoff | None = None,
) -> TrainResult:
    """Steps 1-5 of ``round_`` (the worker's round when None). ``eager_from``: eager overlap,
    training starts from θ minus the estimated step of that round's aggregate in flight.
    ``merging`` (overlap "merge"): the aggregate in flight is merged at step τ
    (``node.daemon.merge``); ``merge`` is rank 0's hand-off from the event loop, and the other
    ranks learn from rank 0 at step τ what to merge (``merge_now``)."""
    worker = ctx.worker
    offset = worker.eager_offset(eager_from) if eager_from is not None else None
    tau = worker.run.merge_step
    if not merging or tau is None:
        return worker.train_and_compress(round_, offset)
    rows = worker.run.merge_rows
    return worker.train_and_compress(
        round_, offset, merge=(tau, rows, lambda: merge_now(ctx, merge))
    )


#: What rank 0 tells the other ranks at step τ of a merging round (on the command channel,
#: inside the ``train`` op): [go, round, base fingerprint, the downloaded payloads' files].
MERGE = "merge"


def merge_now(ctx: RankContext, handoff: Handoff | None) -> None:
    """(compute thread, after τ inner steps or inside step τ) Wait for round
    ``handoff.round``'s gather set, check θ against its base, validate and merge it
    (``Worker.merge``).

    Rank 0 holds the hand-off (``handoff``); on a node of several ranks it tells the others,
    which wait on the command channel meanwhile (as long as the transfers take), whether to
    merge and what: the round, its base and the payload files it downloaded. Nothing to merge
    is ``Abandoned`` on every rank; the base check and the validation are agreed as ever."""
    group = ctx.group
    if handoff is not None:
        try:
            gathered = handoff.wait()
        except Abandoned:
            group.send_op(MERGE, [False, handoff.round, None, {}])
            raise
        round_, base, sources = handoff.round, gathered.manifest.base_fingerprint, gathered.blobs
        group.send_op(MERGE, [True, round_, base, sources])
    else:
        name, args = group.receive_op()
        if name != MERGE or len(args) != 4:
            raise RanksError(f"rank {group.rank} expected the merge at step τ, got {name!r}")
        go, round_, base, sources = args
        if not go:
            raise Abandoned()
    worker = ctx.worker
    if base is not None and base != worker.fingerprint():
        if handoff is not None:
            handoff.diverged = True
        raise Abandoned()
    claims = None if handoff is None else gathered.manifest.steps()
    invalid = read_gather(ctx, round_, sources, claims=claims)
    try:
        screened = worker.merge(worker.gathered)
    finally:
        worker.gathered = {}
    if handoff is not None:
        handoff.applied = (invalid, screened)


@op
def read_gather(
    ctx: RankContext,
    round_: int,
    sources: dict[str, Any],
    *,
    claims: Mapping[str, int | None] | None = None,
) -> dict[str, str]:
    """Validate every gathered payload (its header, and this rank's tensors' records) against
    the run and the manifest; the ones that fail, with the reason, the same on every rank. The
    valid ones wait in the worker for ``apply``. ``sources``: bytes, or downloaded files.
    ``claims`` (rank 0): the steps the manifest lists per node, which each header must repeat."""
    worker = ctx.worker
    worker.gathered = {}
    rejected: dict[str, str] = {}
    nodes = sorted(sources)
    for node in nodes:
        try:
            payload = worker.read(sources[node])
            check_payload_header(
                payload, run_id=worker.run_id, round_=round_, node_id=node,
                steps=None if claims is None else claims.get(node),
            )  # fmt: skip
            worker.gathered[node] = payload
        except PayloadError as exc:
            rejected[node] = f"failed validation: {exc}"
    if ctx.group.world > 1:
        verdicts = ctx.group.flags([n in rejected for n in nodes], "agreeing which payloads fail")
        for node, bad in zip(nodes, verdicts, strict=True):
            if bad and node not in rejected:
                rejected[node] = "failed validation (a tensor another rank of this node read)"
                worker.gathered.pop(node, None)
    return rejected


@op
def apply(ctx: RankContext) -> dict[str, str]:
    """Steps 7-8 with the payloads ``read_gather`` kept; the peers screened out."""
    worker = ctx.worker
    try:
        return worker.apply(worker.gathered)
    finally:
        worker.gathered = {}


@op
def settle(ctx: RankContext, round_: int, aggregated: bool) -> tuple[float, float]:
    """The own contribution of ``round_``: Σĉ (what peers add for this node), and step 9 when
    it was not aggregated; then Σe. ĉ is forgotten afterwards."""
    worker = ctx.worker
    recon = worker.own_recon(round_)
    carried = worker.sent_mass(recon)
    if not aggregated:
        worker.return_own(recon)
    worker.forget(round_)
    return carried, worker.held_mass()


@op
def give_back(ctx: RankContext, round_: int) -> None:
    """Step 9 for a trained round that will not be aggregated (a resync, a round trained from a
    θ that is gone); ĉ is forgotten."""
    worker = ctx.worker
    worker.return_own(worker.own_recon(round_))
    worker.forget(round_)


@op
def after_apply(ctx: RankContext, trained: bool, evaluate: bool) -> tuple[str, float | None, float]:
    """After applying: the held-out loss if asked (and its seconds), then the state
    (``pending.save_applied``). θ_{r+1}'s fingerprint, the loss, the seconds."""
    if ctx.shard is None:
        raise RuntimeError("the node's compute is not set up yet")
    t0 = time.perf_counter()
    loss = ctx.worker.evaluate() if evaluate else None
    eval_s = time.perf_counter() - t0
    return saves.save_applied(ctx.shard, trained=trained), loss, eval_s


@op
def fingerprint(ctx: RankContext) -> str:
    return ctx.worker.fingerprint()


# -- checkpoints, resets, faults ----------------------------------------------------------------


@op
def write_checkpoint(ctx: RankContext, path: str) -> tuple[int, str, str]:
    """θ as one safetensors file at ``path`` (each rank writes its tensors into it); its size,
    sha256 (rank 0) and θ's fingerprint."""
    return write_checkpoint_file(ctx.worker, Path(path))


@op
def load_checkpoint(ctx: RankContext, path: str, round_: int, expected: str) -> None:
    """θ from a downloaded checkpoint file, each rank its tensors, checked against
    ``expected`` (``CheckpointError`` on every rank if anything fails)."""
    load_checkpoint_file(ctx.worker, Path(path), round_=round_, expected=expected)


@op
def reset_to_initial(ctx: RankContext) -> None:
    ctx.worker.reset_to_initial()
