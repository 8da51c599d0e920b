"""The node's compute: inner training, compression and the outer step, on plain tensors.

Synchronous and free of network I/O: the daemon runs every method here in its single compute
thread, off the event loop, one call at a time (numba's parallel pool and torch must not be
entered from two threads at once). Holds the model (whose parameters *are* θ between rounds),
the error-feedback buffer, AdamW, the data stream and the evaluation batches.

Nothing is computed twice on the way of a round: θ's fingerprint is computed once per value of
θ and kept until θ changes (every caller asks ``fingerprint()``); the payload is hashed once, in
the compute thread, when it is made; ĉ (what the payload carries, densely) comes from the
encoder and is used as is for the error-feedback account and step 9, and the own payload is
decoded only when ĉ was lost with a restart. Where the inner steps run, and how θ_r gets there
and the pseudo-gradient back, is ``node.compute.placement``'s: on the CPU in place (training works
on a copy of θ_r, θ_r's memory is handed back, one copy of θ a round), on a GPU in a copy of the
model there; θ, e, the codec and the aggregation stay on the CPU either way, so nodes on any
device stay bit-identical. The mass sums of the account are ``node.compute.mass``'s.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from node.compute.data import Corpus, open_corpus
from node.compute.inner import InnerLoop
from node.compute.mass import abs_total, total
from node.compute.model import build_model, get_preset
from node.compute.optim import InnerOptimConfig, make_adamw
from node.compute.outer import add_back, apply_aggregate, compress, feed_error
from node.compute.placement import Placement, resolve_device
from node.compute.state import NodeState, Writes, adam_tensors, restore_adam
from node.compute.throughput import Meter, Throughput
from node.errors import CheckpointError
from protocol.codec import Payload, decode, read_payload
from protocol.errors import PayloadError
from protocol.fingerprint import fingerprint
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.worker")


@dataclass
class TrainResult:
    """One round's local work: the payload and what the daemon needs to account for it."""

    payload: bytes
    #: sha256 (hex) of ``payload``, computed once.
    sha256: str
    #: Fingerprint of θ_round, the parameters trained from.
    base: str
    #: ĉ: the dense fp32 reconstruction of what ``payload`` carries (``decode`` gives the same).
    recon: dict[str, torch.Tensor]
    train_loss: float
    train_s: float
    encode_s: float
    #: Σ(β·e + Δ) and Σ|β·e + Δ| in float64: the mass this round had to send or keep.
    computed: float = 0.0
    scale: float = 0.0
    #: Σe right after compression: what the round kept (before step 9 may add ĉ back).
    held: float = 0.0
    #: Tokens per second of the inner steps and their MFU (``node.compute.throughput``).
    throughput: Throughput | None = None


class Worker:
    """One participant's model, optimiser, error buffer and data."""

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
    ) -> None:
        """``device``: where the inner steps run (``auto``, ``cpu``, ``cuda:N``); ``separate``
        trains in a copy of the model even on the CPU (the device path, for tests)."""
        self.run = run
        self.run_id = run_id
        self.node_id = node_id
        self.slot = slot
        self.model_cfg = get_preset(run.model)
        self.model = build_model(self.model_cfg, seed=run.seed)
        self.corpus = open_corpus(
            data, ctx_len=self.model_cfg.ctx_len, vocab_size=self.model_cfg.vocab_size
        )
        self.eval_set = self.corpus.eval_batches(eval_batches, eval_batch_size)
        self.optim_cfg = InnerOptimConfig(
            lr=run.inner_lr,
            warmup_steps=run.warmup_steps,
            total_steps=run.total_inner_steps,
        )
        self.placement = Placement(self.model, resolve_device(device), separate=separate)
        train_model = self.placement.train_model
        self.opt = make_adamw(train_model, self.optim_cfg)
        self.inner = InnerLoop(run, train_model, self.opt, self.optim_cfg, self.corpus, slot)
        self.meter = Meter(self.model_cfg, self.placement.device)
        self.tokens_per_step = run.batch_size * self.model_cfg.ctx_len
        self.error = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.shapes = {n: tuple(p.shape) for n, p in self.params.items()}
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
        #: Files of the local state being written behind (``node.compute.state``): every method
        #: that changes θ waits for θ's, training waits for AdamW's.
        self.writes = Writes()

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.model.named_parameters()}

    def fingerprint(self) -> str:
        """Fingerprint of θ, computed once per value of θ (every change of θ forgets it)."""
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.params)
        return self._fingerprint

    # -- state ---------------------------------------------------------------------------------

    def snapshot(self, phase: str = "idle") -> NodeState:
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
        self, round_: int | None = None, offset: Mapping[str, torch.Tensor] | None = None
    ) -> TrainResult:
        """Steps 1-5: H inner steps from θ, pseudo-gradient, error feedback, encode.

        ``round_`` is the round trained (its data, schedule and payload header): by default the
        one after θ's, ``self.round``; with overlap it is one later (θ lacks the aggregate still
        in flight). ``offset`` (eager overlap, ``eager_offset``) is the estimate of that
        aggregate's step: training then starts from θ - offset and the pseudo-gradient is taken
        from there, while the payload's base stays θ's fingerprint.

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
            losses = self.inner.train(
                trained_round,
                lr_scale=lambda: self.lr_scale(trained_round),
                stop=self.stop,
                on_step=self._count_step,
            )
            self.placement.synchronize()
            inner_s = time.perf_counter() - t_inner
        except BaseException:
            # θ is θ_round; e was not touched yet. The AdamW moments keep the steps taken:
            # they are local and never shared, so that loses nothing.
            self.placement.abandon()
            raise
        delta = self.placement.finish()  # θ - θ_trained; θ is bit for bit θ_round
        self._fingerprint = base
        if offset is not None:
            with torch.no_grad():
                for n, d in delta.items():
                    d.sub_(offset[n])  # from θ - offset, where training started
        t1 = time.perf_counter()
        feed_error(self.error, delta, self.run.beta)
        computed = total(self.error)
        scale = abs_total(self.error)
        payload, recon = compress(
            self.error,
            topk=self.run.topk,
            tile=self.run.tile,
            run_id=self.run_id,
            round=trained_round,
            node_id=self.node_id,
            base=base,
        )
        sha256 = hashlib.sha256(payload).hexdigest()
        # Under overlap e changes again before this round is settled: its account is taken now.
        held = total(self.error) if self.run.overlaps else 0.0
        t2 = time.perf_counter()
        return TrainResult(
            payload=payload,
            sha256=sha256,
            base=base,
            recon=recon,
            train_loss=sum(losses) / len(losses),
            train_s=t1 - t0,
            encode_s=t2 - t1,
            computed=computed,
            scale=scale,
            held=held,
            throughput=self.meter.measure(len(losses) * self.tokens_per_step, inner_s),
        )

    def _count_step(self) -> None:
        self.local_steps += 1

    def reset_theta(self, theta: Mapping[str, torch.Tensor], fp: str | None = None) -> None:
        """Set θ to ``theta`` (``fp``: its fingerprint, if known). For the tests' hostile nodes
        (``node.daemon.attacks``); the round loop never sets θ but through its steps."""
        self._reset_to(theta, fp)

    def _reset_to(self, theta: Mapping[str, torch.Tensor], fp: str | None = None) -> None:
        """Set θ; ``fp`` is its fingerprint when the caller knows it (else computed on demand)."""
        self.writes.theta.wait()
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(theta[name])
        self._fingerprint = fp

    def read(self, data: bytes) -> Payload:
        """Validate a peer's payload against this run's model and codec (``PayloadError``)."""
        # Lazy: validated completely now, decoded again tensor by tensor while aggregating, so
        # a round (or a long catch-up) holds one decoded tensor per peer, not G models' worth.
        return read_payload(data, self.shapes, topk=self.run.topk, tile=self.run.tile, lazy=True)

    def apply(self, payloads: Mapping[str, Payload]) -> dict[str, str]:
        """Steps 7-8: θ -= α · aggregate, in canonical order; then the next round.

        Returns the peers screened out (``node.compute.robust``), with the reason.
        """
        self.writes.theta.wait()
        self.previous_fingerprint = self._fingerprint
        eager = self.run.overlap == "eager"
        before = {n: p.clone() for n, p in self.params.items()} if eager else None
        screening = apply_aggregate(
            self.params, payloads, alpha=self.run.alpha, clip=self.run.clip, robust=self.run.robust
        )
        if before is not None:
            with torch.no_grad():
                for n, p in self.params.items():
                    before[n].sub_(p)
            self.last_step = before
            self.last_gathered = len(payloads) - len(screening.rejected)
        self._fingerprint = None
        self.round += 1
        return screening.rejected

    def eager_offset(self, own: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """(eager overlap) The estimate of the step the aggregate in flight will take, given
        this node's own part of it (ĉ): its 1/G share of it fresh, the other (G-1)/G as the
        last aggregate's step, α·A_{r-1} (G: the peers that aggregate had). None without a
        last aggregate (the first round, or after a restart): training then starts from θ.
        Computed into the last step's memory, which it consumes."""
        step, peers = self.last_step, self.last_gathered
        self.last_step = None
        if step is None or peers < 1:
            return None
        with torch.no_grad():
            for n, t in step.items():
                t.mul_((peers - 1) / peers).add_(own[n], alpha=self.run.alpha / peers)
        return step

    def own_recon(self, payload: bytes) -> dict[str, torch.Tensor]:
        """ĉ of this node's own payload, decoded (only needed when a restart lost it)."""
        return decode(payload, self.shapes)

    def return_own(self, recon: Mapping[str, torch.Tensor]) -> None:
        """Step 9: the node's own payload was not aggregated; put ĉ back into e."""
        add_back(self.error, recon)

    def sent_mass(self, recon: Mapping[str, torch.Tensor]) -> float:
        """Σ of what a payload carries (what peers add for this node), from its ĉ."""
        return total(recon)

    def held_mass(self) -> float:
        return total(self.error)

    def evaluate(self) -> float:
        return self.placement.evaluate(self.eval_set)

    def corrupt(self) -> None:
        """Flip the lowest bit of one parameter (fault injection: a silently diverged node)."""
        self.writes.theta.wait()
        first = next(iter(self.params.values()))
        with torch.no_grad():
            first.view(-1)[:1].view(torch.int32).bitwise_xor_(1)
        self._fingerprint = None

    # -- checkpoints -----------------------------------------------------------------------------

    def checkpoint_bytes(self) -> tuple[bytes, str, str]:
        """θ as a safetensors file, its sha256 (hex) and θ's fingerprint."""
        params = {n: t.detach().cpu().contiguous() for n, t in self.params.items()}
        data = save_safetensors(params, metadata={"run_id": self.run_id})
        return data, hashlib.sha256(data).hexdigest(), self.fingerprint()

    def load_checkpoint(self, data: bytes, *, round_: int, expected: str) -> None:
        """Set θ from a checkpoint file after checking names, shapes and fingerprint.

        safetensors holds only tensors (no code), so a hostile file can at worst be wrong,
        which the fingerprint check catches. The error buffer and AdamW stay as they are.
        """
        try:
            tensors = load_safetensors(data)
        except Exception as exc:  # safetensors raises several types for bad bytes
            raise CheckpointError(f"checkpoint of round {round_} is unreadable: {exc}") from exc
        got = {n: tuple(t.shape) for n, t in tensors.items()}
        if got != self.shapes or any(t.dtype != torch.float32 for t in tensors.values()):
            raise CheckpointError(f"checkpoint of round {round_} does not match the model")
        actual = fingerprint(tensors)
        if actual != expected:
            raise CheckpointError(
                f"checkpoint of round {round_} has fingerprint {actual}, expected {expected}"
            )
        self._reset_to(tensors, actual)
        self.round = round_
        self.previous_fingerprint = None
        self.last_step = None

    def reset_to_initial(self) -> None:
        """θ_0 from the run's seed, round 0 (for a replay from the start)."""
        initial = build_model(self.model_cfg, seed=self.run.seed)
        self._reset_to({n: p.data for n, p in initial.named_parameters()})
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
