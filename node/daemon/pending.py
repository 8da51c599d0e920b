"""The round a node has trained but not yet applied, and how it survives a restart.

Between compressing round r and applying round r's aggregate, a node holds exactly one
``PendingRound`` (on rank 0, which runs the daemon): its payload (with the sha256 computed
once), the fingerprint of θ_r it trained from, the error-feedback mass it had to send or keep,
and what it will report about the round. ĉ, the dense reconstruction of what the payload
carries, is kept by each rank's ``Worker`` for its own tensors (``Worker.recon``). ``None``
means nothing is pending: the node is between rounds or only catching up.

On disk the same fact is the state file's phase ``submitting`` (its error buffer already has ĉ
subtracted) plus ``pending-{r}.slc`` with the payload bytes, both written atomically
(``node.compute.state``). A restart rebuilds the ``PendingRound`` from them; each rank decodes
its part of ĉ from that file again, the only time a node decodes its own payload. After the
aggregate is applied nothing is committed: the state on disk stays "submitting r" until the
next round's replaces it, and a restart in between finishes round r again from its manifest, as
after a crash mid-apply (θ_{r+1} goes to its own files behind, for the next commit to point at).

The save functions here run on every rank of a node at once (``node.daemon.ops``): each writes
its own tensors and the commit is agreed between them (``node.compute.state.commit_state``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from node.compute.group import Group
from node.compute.state import (
    STATE_FILE,
    NodeState,
    RankFiles,
    commit_state,
    load_pending,
    pending_path,
    save_adam,
    save_pending,
    save_state,
    save_theta,
    theta_saved,
)
from node.compute.stateread import load_state
from node.compute.worker import TrainResult, Worker
from node.errors import StateError
from protocol.codec import payload_base, payload_work

log = logging.getLogger("sparseloco.node")

#: State-file extra holding ``[computed, scale, held]`` of the pending round's mass.
MASS_KEY = "mass_in"


@dataclass
class PendingRound:
    """One trained, compressed round on its way to being applied."""

    round: int
    payload: bytes
    sha256: str
    #: Fingerprint of θ_round, the parameters the payload was trained from.
    base: str
    #: Σ(β·e + Δ) and Σ|β·e + Δ| before compression; None if a restart lost them.
    computed: float | None = None
    scale: float | None = None
    #: Σe right after compression (overlap: e moves on before the round is settled).
    held: float | None = None
    train_loss: float | None = None
    #: Tokens per second of the round's inner steps and their MFU (None: unknown).
    tokens_per_s: float | None = None
    mfu: float | None = None
    bytes_up: int = 0
    #: Seconds per phase of this round on this node, for the report.
    timings: dict[str, float] = field(default_factory=dict)
    #: When the submit went out (the daemon's clock), to time the wait for the manifest.
    submitted_at: float | None = None
    #: The work the payload carries (its header's), and the entries per tile it sends.
    steps: int | None = None
    tokens: int | None = None
    topk: int | None = None
    #: What cut the round short (``RoundReport.cut``), None if nothing did.
    cut: str | None = None

    @classmethod
    def trained(cls, round_: int, result: TrainResult) -> PendingRound:
        return cls(
            round=round_,
            payload=result.payload,
            sha256=result.sha256,
            base=result.base,
            computed=result.computed,
            scale=result.scale,
            held=result.held,
            train_loss=result.train_loss,
            tokens_per_s=result.throughput.tokens_per_s if result.throughput else None,
            mfu=result.throughput.mfu if result.throughput else None,
            timings={"train": result.train_s, "encode": result.encode_s},
            steps=result.steps or None,
            tokens=result.tokens or None,
            topk=result.topk or None,
        )

    @property
    def mass(self) -> list[float | None] | None:
        """What the state file keeps of the round's mass account."""
        if self.computed is None:
            return None
        return [self.computed, self.scale, self.held]


@dataclass
class Shard:
    """One process's part of a node between its ops: its worker, state dir and commits."""

    state_dir: Path
    group: Group
    worker: Worker
    #: The sequence number of the last commit of the state (every rank counts alike).
    seq: int = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq


def save_submitting(
    shard: Shard, round_: int, mass: list[float | None] | None, payload: bytes | None = None
) -> float:
    """Persist a just-compressed round: the payload first (rank 0 passes it), then the state
    that points at it (e and the header; θ_r's file was written behind during training), then
    AdamW behind. The seconds it took (the round's ``save`` phase)."""
    t0 = time.perf_counter()
    worker, group, state_dir = shard.worker, shard.group, shard.state_dir
    worker.writes.theta.wait()
    if payload is not None:
        save_pending(state_dir, round_, payload)
    snapshot = worker.snapshot("submitting", seq=shard.next_seq())
    if mass is not None:
        snapshot.extra[MASS_KEY] = mass
    files = RankFiles.of(state_dir, group)
    if not theta_saved(files, snapshot.round, snapshot.fingerprint):
        # θ changed without the round loop's steps (a resync, a test's hostile node): now.
        save_theta(files, snapshot.round, snapshot.theta, snapshot.fingerprint)
    commit_state(state_dir, snapshot, group)
    adam, steps = snapshot.adam, snapshot.local_steps
    worker.writes.adam.start(lambda: save_adam(files, round_, adam, steps))
    return time.perf_counter() - t0


def save_idle(shard: Shard) -> str:
    """Persist θ, e and AdamW with nothing pending, all of it now; the saved θ's fingerprint."""
    shard.worker.writes.wait()
    snapshot = shard.worker.snapshot("idle", seq=shard.next_seq())
    save_state(shard.state_dir, snapshot, shard.group)
    return snapshot.fingerprint


def save_applied(shard: Shard, *, trained: bool) -> str:
    """After a round's aggregate is applied: θ_{r+1}'s fingerprint. If the node trained the
    round, θ_{r+1} is written behind (the state written when training ended is what a restart
    finishes the round again from); if not, the whole state is written now."""
    if not trained:
        return save_idle(shard)
    worker, group, state_dir = shard.worker, shard.group, shard.state_dir
    fp = worker.fingerprint()
    round_, theta, files = worker.round, worker.params, RankFiles.of(state_dir, group)
    worker.writes.theta.start(lambda: save_theta(files, round_, theta, fp))
    return fp


def resume(state_dir: Path, state: NodeState, worker: Worker) -> PendingRound | None:
    """(rank 0) The pending round a saved state describes, or None if the state was idle. Its
    base is the one the payload names (θ_r's fingerprint; with overlap θ_{r-1}'s)."""
    if state.phase != "submitting":
        return None
    payload = load_pending(state_dir, state.round)
    if payload is None:
        raise StateError(f"{state_dir}: state says a payload is pending but none is")
    mass = state.extra.get(MASS_KEY)
    steps, tokens = payload_work(payload, worker.shapes)
    return PendingRound(
        round=state.round,
        payload=payload,
        sha256=hashlib.sha256(payload).hexdigest(),
        base=payload_base(payload, worker.shapes),
        steps=steps or None,
        tokens=tokens or None,
        computed=None if mass is None else float(mass[0]),
        scale=None if mass is None else float(mass[1]),
        held=None if mass is None or len(mass) < 3 or mass[2] is None else float(mass[2]),
    )


def restore_state(shard: Shard) -> tuple[PendingRound | None, bool]:
    """(every rank) Load this rank's share of the state dir into the worker: the pending round
    (rank 0) and whether state was restored.

    A torn or damaged state file is set aside (kept as evidence) and the node recovers from the
    object store instead; state of another run or node is refused. Every rank takes the same
    branch: one rank's unreadable file is the node's.
    """
    worker, group, state_dir = shard.worker, shard.group, shard.state_dir
    failure: StateError | None = None
    state: NodeState | None = None
    try:
        state = load_state(
            state_dir, worker.owned_shapes, group.rank, group.world, every=worker.shapes
        )
    except StateError as exc:
        failure = exc
    if group.any(failure is not None, "reading the state"):
        if group.leader:
            aside = state_dir / f"{STATE_FILE}.damaged-{int(time.time())}"
            (state_dir / STATE_FILE).rename(aside)
            log.warning(
                "event=state_damaged node=%s moved_to=%s error=%r",
                worker.node_id,
                aside,
                failure or "another rank could not read its part",
            )
        group.barrier("setting the damaged state aside")
        state = None
    if state is None:
        return None, False
    if state.run_id != worker.run_id or state.node_id != worker.node_id:
        raise StateError(
            f"{state_dir} holds node {state.node_id!r} of run {state.run_id!r}, not"
            f" {worker.node_id!r} of {worker.run_id!r}; use another --state-dir"
        )
    worker.restore(state)
    shard.seq = state.seq
    pending = resume(state_dir, state, worker) if group.leader else None
    if group.leader:
        log.info(
            "event=resumed node=%s round=%d phase=%s world=%d",
            worker.node_id, state.round, state.phase, group.world,
        )  # fmt: skip
    if state.phase == "submitting":
        # ĉ of the pending round, decoded from the payload rank 0 wrote (each rank its part).
        worker.own_recon(state.round, pending_path(state_dir, state.round))
    return pending, True
