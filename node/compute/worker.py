"""The node's compute: inner training, compression and the outer step, on plain tensors.

Synchronous and free of network I/O: the daemon runs every method here in its single compute
thread, off the event loop, one call at a time (numba's parallel pool and torch must not be
entered from two threads at once). Holds the model, θ, the error-feedback buffer, AdamW, the
data stream and the evaluation batches.

**One process or several.** A ``Worker`` is one process's share of a node (``group``: its rank
of the node's ``world``). With one process it holds the whole model and θ *is* the model's
parameters, as always. Under torchrun every rank builds a ``Worker`` and the ranks call the same
methods in the same order (``node.daemon.ops`` sees to that): each owns some whole tensors
(``node.compute.sharding``) and holds θ and e for those only, on its own device; the inner steps
run on FSDP2 over all ranks (``node.compute.fsdp``); the codec, the aggregation, the mass sums
and the fingerprint run per rank on its own tensors, with the few cross-rank results (screening
counts, digests, sums, verdicts) agreed through ``Group``. Per tensor the arithmetic is the
single process's, so θ is bit for bit the same whatever the rank count.

Nothing is computed twice on the way of a round: θ's fingerprint is computed once per value of
θ and kept until θ changes; the payload is hashed once, on rank 0, when it is made; ĉ (what the
payload carries, densely) comes from the encoder, is kept per round (``recon``) and used for the
error-feedback account and step 9; the own payload is decoded only when ĉ was lost with a
restart. θ, e, the codec and the aggregation of a single process stay on the CPU whatever the
training device (``node.compute.placement``), so nodes on any device stay bit-identical.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from node.compute.data import Corpus, open_corpus
from node.compute.files import Writes
from node.compute.fsdp import ShardedPlacement
from node.compute.group import Group
from node.compute.inner import InnerLoop
from node.compute.mass import abs_total, total
from node.compute.model import build_model, get_preset, initial_tensors, model_shapes
from node.compute.optim import InnerOptimConfig, adam_tensors, make_adamw, restore_adam
from node.compute.outer import add_back, apply_aggregate, compress, feed_error
from node.compute.placement import Placement, resolve_device
from node.compute.sharding import assign
from node.compute.shards import encode_tensors, node_fingerprint, node_payload
from node.compute.state import NodeState
from node.compute.throughput import Meter, StepClock, Throughput
from node.errors import RanksError
from protocol.codec import Payload, read_payload, read_payload_file
from protocol.errors import PayloadError
from protocol.fingerprint import fingerprint
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.worker")

#: A payload to read: its bytes, or the file it was downloaded to.
Source = bytes | str | Path


@dataclass
class TrainResult:
    """One round's local work: the payload and what the daemon needs to account for it."""

    #: The whole payload (rank 0; empty on the other ranks of a node).
    payload: bytes
    #: sha256 (hex) of ``payload``, computed once (rank 0).
    sha256: str
    #: Fingerprint of θ_round, the parameters trained from.
    base: str
    #: ĉ of this process's tensors: the dense fp32 reconstruction of what ``payload`` carries.
    recon: dict[str, torch.Tensor]
    train_loss: float
    #: Seconds from the round's start to the pseudo-gradient (the inner steps among them).
    train_s: float
    encode_s: float
    #: Seconds of the inner steps alone.
    inner_s: float = 0.0
    #: Σ(β·e + Δ) and Σ|β·e + Δ| in float64 over the node: what this round had to send or keep.
    computed: float = 0.0
    scale: float = 0.0
    #: Σe right after compression: what the round kept (before step 9 may add ĉ back).
    held: float = 0.0
    #: Tokens per second of the inner steps and their MFU (``node.compute.throughput``).
    throughput: Throughput | None = None


def _rank_device(spec: str | torch.device, group: Group) -> torch.device:
    """Where a rank keeps its tensors: its own GPU (``LOCAL_RANK``) when the node trains on
    CUDA under torchrun, else the device asked for."""
    device = resolve_device(spec)
    if device.type == "cuda" and group.distributed:
        return torch.device("cuda", group.local_rank)
    return device


class Worker:
    """One process's share of a participant: model, optimiser, θ, error buffer and data."""

    def __init__(
        self,
        run: RunConfig,
        *,
        run_id: str,
        node_id: str,
        slot: int,
        data: str | Corpus | None = None,
        eval_batches: int = 4,
        eval_batch_size: int = 8,
        device: str | torch.device = "cpu",
        separate: bool = False,
        group: Group | None = None,
    ) -> None:
        """``device``: where the inner steps run (``auto``, ``cpu``, ``cuda:N``); ``separate``
        trains in a copy of the model even on the CPU (the device path, for tests); ``group``:
        this process's rank of the node (one process by default)."""
        self.run = run
        self.run_id = run_id
        self.node_id = node_id
        self.slot = slot
        self.group = group or Group.solo()
        self.model_cfg = get_preset(run.model)
        #: Every tensor of the model (what a payload must hold), and the ones this rank owns.
        self.shapes = model_shapes(self.model_cfg)
        self.owners = assign(self.shapes, self.group.world)
        self.owned = [n for n in sorted(self.shapes) if self.owners[n] == self.group.rank]
        self.corpus = open_corpus(
            data, ctx_len=self.model_cfg.ctx_len, vocab_size=self.model_cfg.vocab_size
        )
        self.eval_set = self.corpus.eval_batches(eval_batches, eval_batch_size)
        self.optim_cfg = InnerOptimConfig(
            lr=run.inner_lr,
            warmup_steps=run.warmup_steps,
            total_steps=run.total_inner_steps,
        )
        self.device = _rank_device(device, self.group)
        #: Under torchrun (any number of processes): θ and e on this rank's device, the
        #: inner steps on FSDP. A plain process keeps θ in the model, on the CPU.
        self.sharded = self.group.distributed
        if self.sharded and run.overlap == "merge":
            raise RanksError(
                'overlap = "merge" runs on a node of one process only (its merge is not'
                " sharded yet); run this node without torchrun, or the run with another overlap"
            )
        self.theta: dict[str, torch.Tensor] = {}
        self.placement: Placement | ShardedPlacement
        if not self.sharded:
            self.model = build_model(self.model_cfg, seed=run.seed)
            self.placement = Placement(self.model, self.device, separate=separate)
        else:
            initial = initial_tensors(self.model_cfg, seed=run.seed, names=self.owned)
            self.theta = {n: t.to(self.device) for n, t in initial.items()}
            self.placement = ShardedPlacement(
                self.model_cfg, self.group, self.device, self.owners, self.theta
            )
            self.model = self.placement.train_model
        train_model = self.placement.train_model
        self.opt = make_adamw(train_model, self.optim_cfg)
        self.inner = InnerLoop(
            run, train_model, self.opt, self.optim_cfg, self.corpus, slot, group=self.group
        )
        self.meter = Meter(self.model_cfg, self.placement.device)
        self.meter.devices = self.group.world
        self.tokens_per_step = run.batch_size * self.model_cfg.ctx_len
        #: The inner steps of the round being trained, timed one by one.
        self.steps = StepClock()
        self.error = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.round = 0
        self.local_steps = 0
        self.stop = threading.Event()
        #: Fingerprint of θ as it is now; None once θ changed (see ``fingerprint``).
        self._fingerprint: str | None = None
        #: Fingerprint of θ before the last aggregate was applied, if it was known then: under
        #: overlap, the base of the round the node applies next.
        self.previous_fingerprint: str | None = None
        #: (eager overlap) The step the last aggregate took, α·A, and how many peers it had.
        self.last_step: dict[str, torch.Tensor] | None = None
        self.last_gathered = 0
        #: ĉ of the rounds trained and not yet settled, by round (this rank's tensors).
        self.recon: dict[int, dict[str, torch.Tensor]] = {}
        #: A settled round's ĉ, whose memory the next encode writes into (``forget``).
        self._spare_recon: dict[str, torch.Tensor] | None = None
        #: The peers' payloads of the round being applied (this rank's tensors of each).
        self.gathered: dict[str, Payload] = {}
        #: Files of the local state being written behind (``node.compute.state``): every method
        #: that changes θ waits for θ's, training waits for AdamW's.
        self.writes = Writes()

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """θ: this rank's tensors (all of them in a single process, the model's own memory)."""
        if isinstance(self.placement, Placement):
            return self.placement.theta()
        return self.theta

    @property
    def owned_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: self.shapes[n] for n in self.owned}

    def node_sum(self, value: float) -> float:
        """A float64 sum over the node's ranks, in rank order (the same on every rank)."""
        return sum(v[0] for v in self.group.gather_floats([value]))

    def fingerprint(self) -> str:
        """Fingerprint of θ, computed once per value of θ (every change of θ forgets it); on a
        node of several ranks each hashes its own tensors and the digests are combined."""
        if self._fingerprint is None:
            if not self.sharded:
                self._fingerprint = fingerprint(self.params)
            else:
                self._fingerprint = node_fingerprint(self.group, self.params)
        return self._fingerprint

    # -- state ---------------------------------------------------------------------------------

    def snapshot(self, phase: str = "idle", seq: int = 0) -> NodeState:
        return NodeState(
            run_id=self.run_id,
            node_id=self.node_id,
            round=self.round,
            theta=self.params,
            error=self.error,
            adam=adam_tensors(self.opt),
            local_steps=self.local_steps,
            phase=phase,  # type: ignore[arg-type]
            fingerprint=self.fingerprint(),
            world=self.group.world,
            seq=seq,
        )

    def restore(self, state: NodeState) -> None:
        self.writes.wait()
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(state.theta[name])
                self.error[name].copy_(state.error[name])
        if state.adam:
            restore_adam(self.opt, state.adam)
        self.round = state.round
        self.local_steps = state.local_steps
        self._fingerprint = None
        self.previous_fingerprint = None
        self.last_step = None

    # -- one round -------------------------------------------------------------------------------

    def lr_scale(self, round_: int) -> float:
        """Linear re-warm-up for an AdamW state that started fresh after round 0."""
        warm = self.run.rewarmup_steps
        if round_ == 0 or warm == 0 or self.local_steps >= warm:
            return 1.0
        return (self.local_steps + 1) / (warm + 1)

    def train_and_compress(
        self,
        round_: int | None = None,
        offset: Mapping[str, torch.Tensor] | None = None,
        merge: tuple[int, Callable[[], None]] | None = None,
    ) -> TrainResult:
        """Steps 1-5: H inner steps from θ, pseudo-gradient, error feedback, encode.

        ``round_`` is the round trained (its data, schedule and payload header): by default the
        one after θ's, ``self.round``; with overlap it is one later (θ lacks the aggregate still
        in flight). ``offset`` (eager overlap, ``eager_offset``) is the estimate of that
        aggregate's step: training then starts from θ - offset and the pseudo-gradient is taken
        from there, while the payload's base stays θ's fingerprint.

        ``merge`` = (τ, fn) (overlap "merge"): ``fn`` runs after τ inner steps; it applies the
        aggregate in flight to θ and the same step to the parameters being trained
        (``Worker.merge``), so the pseudo-gradient is taken from the new θ, which the payload
        names as its base.

        Afterwards the model holds θ again and ``error`` has the sent part subtracted.
        Raises ``node.errors.Abandoned`` (θ and e untouched) if ``stop`` is set between inner steps.
        """
        trained_round = self.round if round_ is None else round_
        t0 = time.perf_counter()
        self.writes.adam.wait()  # the moments of the previous round are on disk
        base = self.fingerprint()
        # Training runs on a copy of θ (or θ - offset); θ itself stays as it is.
        self.placement.begin(offset)
        try:
            t_inner = time.perf_counter()
            self.steps.start()
            on_step = self._count_step if merge is None else self._merging_at(*merge)
            losses = self.inner.train(
                trained_round,
                lr_scale=lambda: self.lr_scale(trained_round),
                stop=self.stop,
                on_step=on_step,
            )
            self.placement.synchronize()
            inner_s = time.perf_counter() - t_inner
        except BaseException:
            # θ is θ_round; e was not touched yet. The AdamW moments keep the steps taken:
            # they are local and never shared, so that loses nothing.
            self.placement.abandon()
            raise
        delta = self.placement.finish()  # θ - θ_trained; θ is bit for bit θ_round (or merged)
        if self._fingerprint is None:  # θ moved at the merge: the payload's base is the new θ
            base = self.fingerprint()
        self._fingerprint = base
        if offset is not None:
            with torch.no_grad():
                for n, d in delta.items():
                    d.sub_(offset[n])  # from θ - offset, where training started
        t1 = time.perf_counter()
        feed_error(self.error, delta, self.run.beta)
        del delta
        computed = self.node_sum(total(self.error))
        scale = self.node_sum(abs_total(self.error))
        payload, recon = self._compress(trained_round, base)
        sha256 = hashlib.sha256(payload).hexdigest() if self.group.leader else ""
        self.recon[trained_round] = recon
        # Under overlap e changes again before this round is settled: its account is taken now.
        held = self.node_sum(total(self.error)) if self.run.overlaps else 0.0
        t2 = time.perf_counter()
        return TrainResult(
            payload=payload,
            sha256=sha256,
            base=base,
            recon=recon,
            train_loss=sum(losses) / len(losses),
            train_s=t1 - t0,
            encode_s=t2 - t1,
            inner_s=inner_s,
            computed=computed,
            scale=scale,
            held=held,
            throughput=self.meter.measure(len(losses) * self.tokens_per_step, inner_s, self.steps),
        )

    def _compress(self, round_: int, base: str) -> tuple[bytes, dict[str, torch.Tensor]]:
        """Steps 4-5 on this rank's tensors; on a node of ranks, rank 0 assembles the payload
        from every rank's records (``node.compute.shards``; the others return no bytes)."""
        run = self.run
        header = {"run_id": self.run_id, "node_id": self.node_id, "base": base}
        if not self.sharded:
            spare, self._spare_recon = self._spare_recon, None
            return compress(
                self.error, topk=run.topk, tile=run.tile, out=spare, round=round_, **header
            )
        records, recon = encode_tensors(
            self.group, self.error, self.shapes, topk=run.topk, tile=run.tile
        )
        for name, e in self.error.items():
            e.sub_(recon[name])
        payload = node_payload(
            self.group, records, topk=run.topk, tile=run.tile, round_=round_, **header
        )
        return payload, recon

    def _count_step(self) -> None:
        self.local_steps += 1
        self.steps.tick()

    def _merging_at(self, tau: int, fn: Callable[[], None]) -> Callable[[], None]:
        """An ``on_step`` that also runs ``fn`` once, after the ``tau``-th step of the round."""
        taken = 0

        def on_step() -> None:
            nonlocal taken
            self._count_step()
            taken += 1
            if taken == tau:
                fn()

        return on_step

    def merge(self, payloads: Mapping[str, Payload]) -> dict[str, str]:
        """(overlap "merge", between two inner steps) Steps 7-8 on θ, exactly as ``apply``,
        and the step they took added to the parameters being trained: θ_local += θ_{r+1} - θ_r.

        The merge is additive (not Streaming DiLoCo's convex mix) so the local trajectory keeps
        every inner step it took and the pseudo-gradient against θ_{r+1} is the node's own
        update of the whole round; at τ = H it is the "delayed" schedule, and the closer τ is
        to 0 the closer to no overlap. θ_{r+1} is the same bits on every node (``apply``);
        the parameters being trained are the node's own and never leave it.
        """
        if not isinstance(self.placement, Placement):
            raise RanksError('overlap = "merge" is not sharded (see __init__)')
        step = {n: p.clone() for n, p in self.params.items()}
        rejected = self.apply(payloads)
        with torch.no_grad():
            for n, p in self.params.items():
                step[n].sub_(p)  # θ_r - θ_{r+1}
        self.placement.shift(step)
        return rejected

    def reset_theta(self, theta: Mapping[str, torch.Tensor], fp: str | None = None) -> None:
        """Set θ to ``theta`` (``fp``: its fingerprint, if known). The round loop never sets θ
        but through its steps; the tests' stale node (``tests/support/hostile.py``) does."""
        self._reset_to(theta, fp)

    def _reset_to(self, theta: Mapping[str, torch.Tensor], fp: str | None = None) -> None:
        """Set θ; ``fp`` is its fingerprint when the caller knows it (else computed on demand)."""
        self.writes.theta.wait()
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(theta[name])
        self._fingerprint = fp

    def read(self, data: Source) -> Payload:
        """Validate a peer's payload against this run's model and codec (``PayloadError``):
        the header whole, the records of this rank's tensors."""
        # Lazy: validated completely now, decoded again tensor by tensor while aggregating, so
        # a round (or a long catch-up) holds one decoded tensor per peer, not G models' worth.
        options = {"topk": self.run.topk, "tile": self.run.tile, "lazy": True}
        only = None if self.group.world == 1 else self.owned
        if isinstance(data, bytes | bytearray | memoryview):
            return read_payload(data, self.shapes, only=only, **options)  # type: ignore[arg-type]
        return read_payload_file(Path(data), self.shapes, only=only, **options)  # type: ignore[arg-type]

    def apply(self, payloads: Mapping[str, Payload]) -> dict[str, str]:
        """Steps 7-8: θ -= α · aggregate, in canonical order; then the next round.

        Returns the peers screened out (``node.compute.robust``), with the reason.
        """
        self.writes.theta.wait()
        self.previous_fingerprint = self._fingerprint
        eager = self.run.overlap == "eager"
        before = {n: p.clone() for n, p in self.params.items()} if eager else None
        options = {"alpha": self.run.alpha, "clip": self.run.clip, "robust": self.run.robust}
        counts = self.group.sum_ints
        if self.device.type == "cuda" and self.sharded:
            from node.compute import device

            screening = device.apply_aggregate(self.params, payloads, combine=counts, **options)  # type: ignore[arg-type]
        else:
            screening = apply_aggregate(self.params, payloads, combine=counts, **options)  # type: ignore[arg-type]
        if before is not None:
            with torch.no_grad():
                for n, p in self.params.items():
                    before[n].sub_(p)
            self.last_step = before
            self.last_gathered = len(payloads) - len(screening.rejected)
        self._fingerprint = None
        self.round += 1
        return screening.rejected

    def eager_offset(self, round_: int) -> dict[str, torch.Tensor] | None:
        """(eager overlap) The estimate of the step the aggregate in flight will take, given
        this node's own part of it (ĉ of round ``round_``): its 1/G share of it fresh, the
        other (G-1)/G as the last aggregate's step, α·A_{r-1} (G: the peers that aggregate
        had). None without a last aggregate (the first round, or after a restart): training
        then starts from θ. Computed into the last step's memory, which it consumes."""
        step, peers = self.last_step, self.last_gathered
        self.last_step = None
        own = self.recon.get(round_)
        if step is None or peers < 1 or own is None:
            return None
        with torch.no_grad():
            for n, t in step.items():
                t.mul_((peers - 1) / peers).add_(own[n], alpha=self.run.alpha / peers)
        return step

    def own_recon(self, round_: int, payload: Source | None = None) -> dict[str, torch.Tensor]:
        """ĉ of this node's own payload of ``round_``: kept from the encoder, or decoded from
        ``payload`` (its bytes or file) when a restart lost it."""
        if round_ not in self.recon:
            if payload is None:
                raise RuntimeError(f"ĉ of round {round_} is neither kept nor given")
            read = self.read(payload)
            self.recon[round_] = {
                n: read.tensors[n].dense().to(self.error[n].device) for n in self.owned
            }
        return self.recon[round_]

    def forget(self, round_: int) -> None:
        """Round ``round_`` is settled: its ĉ is not needed any more, and its memory takes the
        next round's (a fresh 4 B/param buffer costs a page fault per 4 KB on first touch)."""
        spare = self.recon.pop(round_, None)
        if spare is not None:
            self._spare_recon = spare

    def return_own(self, recon: Mapping[str, torch.Tensor]) -> None:
        """Step 9: the node's own payload was not aggregated; put ĉ back into e."""
        add_back(self.error, recon)

    def sent_mass(self, recon: Mapping[str, torch.Tensor]) -> float:
        """Σ of what a payload carries (what peers add for this node), from its ĉ."""
        return self.node_sum(total(recon))

    def held_mass(self) -> float:
        return self.node_sum(total(self.error))

    def evaluate(self) -> float:
        return self.placement.evaluate(self.eval_set)

    def corrupt(self) -> None:
        """Flip the lowest bit of one parameter (fault injection: a silently diverged node)."""
        self.writes.theta.wait()
        first = min(self.shapes)
        if first in self.params:
            with torch.no_grad():
                self.params[first].view(-1)[:1].view(torch.int32).bitwise_xor_(1)
        self._fingerprint = None

    def reset_to_initial(self) -> None:
        """θ_0 from the run's seed, round 0 (for a replay from the start)."""
        if not self.sharded:
            initial = build_model(self.model_cfg, seed=self.run.seed)
            theta = {n: p.data for n, p in initial.named_parameters()}
        else:
            theta = initial_tensors(self.model_cfg, seed=self.run.seed, names=self.owned)
        self._reset_to(theta)
        self.round = 0
        self.previous_fingerprint = None
        self.last_step = None


def check_payload_header(payload: Payload, *, run_id: str, round_: int, node_id: str) -> None:
    """A gathered payload must say it is for this run, this round and the node it came from."""
    for field, got, want in (
        ("header.run", payload.run_id, run_id),
        ("header.round", payload.round, round_),
        ("header.node", payload.node_id, node_id),
    ):
        if got != want:
            raise PayloadError(field, f"payload says {got!r}, manifest says {want!r}")
