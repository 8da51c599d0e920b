"""The round a node has trained but not yet applied, and how it survives a restart.

Between compressing round r and applying round r's aggregate, a node holds exactly one
``PendingRound``: its payload (with the sha256 computed once), the fingerprint of θ_r it
trained from, ĉ (the dense reconstruction of what the payload carries, kept from the encoder),
the error-feedback mass it had to send or keep, and what it will report about the round.
``None`` means nothing is pending: the node is between rounds or only catching up.

On disk the same fact is the state file's phase ``submitting`` (its error buffer already has ĉ
subtracted) plus ``pending-{r}.slc`` with the payload bytes, both written atomically
(``node.compute.state``). A restart rebuilds the ``PendingRound`` from them; ĉ is then decoded
from the payload again, the only time the node decodes its own payload. After the aggregate is
applied nothing is committed: the state on disk stays "submitting r" until the next round's
replaces it, and a restart in between finishes round r again from its manifest, as after a
crash mid-apply (θ_{r+1} goes to its own file behind, for the next commit to point at).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from node.compute.data import Corpus
from node.compute.state import (
    STATE_FILE,
    NodeState,
    commit_state,
    load_pending,
    load_state,
    save_adam,
    save_pending,
    save_state,
    save_theta,
    theta_saved,
)
from node.compute.worker import TrainResult, Worker
from node.daemon.settings import NodeSettings
from node.errors import StateError
from protocol.codec import body_limit
from protocol.envelope import unpack_envelope
from protocol.messages import JoinResponse

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
    #: ĉ from the encoder; None after a restart (decode ``payload`` when it is needed).
    recon: dict[str, torch.Tensor] | None
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

    @classmethod
    def trained(cls, round_: int, result: TrainResult) -> PendingRound:
        return cls(
            round=round_,
            payload=result.payload,
            sha256=result.sha256,
            base=result.base,
            recon=result.recon,
            computed=result.computed,
            scale=result.scale,
            held=result.held,
            train_loss=result.train_loss,
            tokens_per_s=result.throughput.tokens_per_s if result.throughput else None,
            mfu=result.throughput.mfu if result.throughput else None,
            timings={"train": result.train_s, "encode": result.encode_s},
        )


def save_submitting(state_dir: Path, worker: Worker, pending: PendingRound) -> None:
    """Persist a just-compressed round: the payload first, then the state that points at it
    (e and the header; θ_r's file was written behind during training), then AdamW behind.
    Its seconds go to the ``save`` phase (``node.compute.state`` has the layout)."""
    t0 = time.perf_counter()
    worker.writes.theta.wait()
    save_pending(state_dir, pending.round, pending.payload)
    snapshot = worker.snapshot("submitting")
    if pending.computed is not None:
        snapshot.extra[MASS_KEY] = [pending.computed, pending.scale, pending.held]
    if not theta_saved(state_dir, snapshot.round, snapshot.fingerprint):
        # θ changed without the round loop's steps (a resync, a test's hostile node): now.
        save_theta(state_dir, snapshot.round, snapshot.theta, snapshot.fingerprint)
    commit_state(state_dir, snapshot)
    adam, steps = snapshot.adam, snapshot.local_steps
    worker.writes.adam.start(lambda: save_adam(state_dir, pending.round, adam, steps))
    pending.timings["save"] = time.perf_counter() - t0


def save_idle(state_dir: Path, worker: Worker) -> str:
    """Persist θ, e and AdamW with nothing pending, all of it now; the saved θ's fingerprint."""
    worker.writes.wait()
    snapshot = worker.snapshot("idle")
    save_state(state_dir, snapshot)
    return snapshot.fingerprint


def save_applied(state_dir: Path, worker: Worker, *, trained: bool) -> str:
    """After a round's aggregate is applied: θ_{r+1}'s fingerprint. If the node trained the
    round, θ_{r+1} is written behind (the state written when training ended is what a restart
    finishes the round again from); if not, the whole state is written now."""
    if not trained:
        return save_idle(state_dir, worker)
    fp = worker.fingerprint()
    round_, theta = worker.round, worker.params
    worker.writes.theta.start(lambda: save_theta(state_dir, round_, theta, fp))
    return fp


def resume(
    state_dir: Path, state: NodeState, shapes: dict[str, tuple[int, ...]]
) -> PendingRound | None:
    """The pending round a saved state describes, or None if the state was idle. Its base is
    the one the payload names (θ_r's fingerprint; with overlap θ_{r-1}'s)."""
    if state.phase != "submitting":
        return None
    payload = load_pending(state_dir, state.round)
    if payload is None:
        raise StateError(f"{state_dir}: state says a payload is pending but none is")
    mass = state.extra.get(MASS_KEY)
    return PendingRound(
        round=state.round,
        payload=payload,
        sha256=hashlib.sha256(payload).hexdigest(),
        base=unpack_envelope(payload, max_body=body_limit(shapes)).base,
        recon=None,
        computed=None if mass is None else float(mass[0]),
        scale=None if mass is None else float(mass[1]),
        held=None if mass is None or len(mass) < 3 or mass[2] is None else float(mass[2]),
    )


def restore(
    s: NodeSettings, joined: JoinResponse, data: Corpus | str | None = None
) -> tuple[Worker, PendingRound | None, bool]:
    """(compute thread) The worker for ``joined``, restored from the state dir when it holds
    usable state: the worker, the pending round, and whether state was restored. ``data`` is
    what it trains on (``NodeDaemon._open_data``).

    A torn or damaged state file is set aside (kept as evidence) and the node recovers from the
    object store instead; state of another run or node is refused.
    """
    if s.threads:
        torch.set_num_threads(s.threads)
    worker = Worker(
        joined.run,
        run_id=joined.run_id,
        node_id=joined.node_id,
        slot=joined.slot,
        data=s.data if data is None else data,
        eval_batches=s.eval_batches,
        eval_batch_size=s.eval_batch_size,
        device=s.device,
    )
    try:
        state = load_state(s.state_dir, worker.shapes)
    except StateError as exc:
        # Torn or damaged: keep the evidence, recover from the object store instead.
        aside = s.state_dir / f"{STATE_FILE}.damaged-{int(time.time())}"
        (s.state_dir / STATE_FILE).rename(aside)
        log.warning("event=state_damaged node=%s moved_to=%s error=%r", joined.node_id, aside, exc)
        state = None
    if state is None:
        return worker, None, False
    if state.run_id != joined.run_id or state.node_id != joined.node_id:
        raise StateError(
            f"{s.state_dir} holds node {state.node_id!r} of run {state.run_id!r}, not"
            f" {joined.node_id!r} of {joined.run_id!r}; use another --state-dir"
        )
    worker.restore(state)
    pending = resume(s.state_dir, state, worker.shapes)
    log.info("event=resumed node=%s round=%d phase=%s", joined.node_id, state.round, state.phase)
    return worker, pending, True
