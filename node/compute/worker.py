"""The steps of a round on one process's share of a node: train, compress, read, apply, settle.

Synchronous and free of network I/O: the daemon runs every method here in its single compute
thread, off the event loop, one call at a time (numba's parallel pool and torch must not be
entered from two threads at once). A ``Worker`` is a ``node.compute.share.Share`` (the model,
θ, e, AdamW, the data; one process's part of a node, or a whole node of one process) with the
round's steps on it. On a node of several ranks the codec, the aggregation, the mass sums and
the fingerprint run per rank on its own tensors, with the few cross-rank results (screening
counts, digests, sums, verdicts) agreed through ``Group``.

Nothing is computed twice on the way of a round: θ's fingerprint is computed once per value of
θ and kept until θ changes; the payload is hashed once, on rank 0, when it is made; ĉ (what the
payload carries, densely) comes from the encoder, is kept per round (``recon``) and used for the
error-feedback account and step 9; the own payload is decoded only when ĉ was lost with a
restart. The codec and the aggregation of a single process run on the CPU whatever the training
device (``node.compute.placement``), so nodes on any device stay bit-identical.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from node.compute.mass import abs_total, total
from node.compute.outer import AggregateOptions, add_back, apply_aggregate, compress, feed_error
from node.compute.shards import encode_tensors, node_payload
from node.compute.share import Share
from node.compute.throughput import Meter, StepClock, Throughput
from node.compute.work import peer_weights
from protocol.codec import Payload, read_payload, read_payload_file
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
    #: The work the payload carries: inner steps taken (H unless the budget cut it), tokens.
    steps: int = 0
    tokens: int = 0
    #: Entries per tile it sends: the run's, or fewer where the link is thin.
    topk: int = 0


class Worker(Share):
    """One process's share of a participant and the steps of a round on it."""

    def __init__(self, run: RunConfig, **share: Any) -> None:
        """``share``: ``Share``'s arguments (the run's ids and slot, data, device, group)."""
        super().__init__(run, **share)
        self.meter = Meter(self.model_cfg, self.placement.device)
        self.meter.devices = self.group.world
        self.tokens_per_step = run.batch_size * self.model_cfg.ctx_len
        #: The inner steps of the round being trained, timed one by one.
        self.steps = StepClock()
        #: ĉ of the rounds trained and not yet settled, by round (this rank's tensors).
        self.recon: dict[int, dict[str, torch.Tensor]] = {}
        #: A settled round's ĉ, whose memory the next encode writes into (``forget``).
        self._spare_recon: dict[str, torch.Tensor] | None = None
        #: The peers' payloads of the round being applied (this rank's tensors of each).
        self.gathered: dict[str, Payload] = {}
        #: (rank 0, set by the daemon from the round's budget, before or during training)
        #: When the round's training must end (``time.monotonic``), and the entries per tile to
        #: send (None: H steps; the run's k). ``node.compute.linkbudget`` plans both.
        self.cutoff: float | None = None
        self.send_topk: int | None = None
        #: The clock ``cutoff`` is on: the daemon's (``time.monotonic`` for a real one).
        self.cutoff_clock: Callable[[], float] = time.monotonic
        #: Called after each inner step with its seconds: the chaos suite's slower GPU
        #: (``node.daemon.faults``, ``slowsteps``); None in a real run.
        self.after_step: Callable[[float], None] | None = None
        self._step_started = 0.0

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
        merge: tuple[int, int | None, Callable[[], None]] | None = None,
    ) -> TrainResult:
        """Steps 1-5: H inner steps from θ, pseudo-gradient, error feedback, encode.

        ``round_`` is the round trained (its data, schedule and payload header): by default the
        one after θ's, ``self.round``; with overlap it is one later (θ lacks the aggregate still
        in flight). ``offset`` (eager overlap, ``eager_offset``) is the estimate of that
        aggregate's step: training then starts from θ - offset and the pseudo-gradient is taken
        from there, while the payload's base stays θ's fingerprint.

        ``merge`` = (τ, rows, fn) (overlap "merge"): ``fn`` runs after τ inner steps, or
        inside step τ after the gradients of its first ``rows`` rows (``RunConfig.merge_rows``);
        it applies the aggregate in flight to θ and the same step to the parameters being
        trained (``Worker.merge``), so the pseudo-gradient is taken from the new θ, which the
        payload names as its base.

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
            self._step_started = t_inner
            self.steps.start()
            on_step, pause = self._count_step, None
            merging_s = [0.0]  # the merge (its wait, decode and apply) is no inner-step work
            if merge is not None:
                tau, rows, outer = merge

                def fn() -> None:
                    start = time.perf_counter()
                    try:
                        outer()
                    finally:
                        merging_s[0] += time.perf_counter() - start

                if rows is None:
                    on_step = self._merging_at(tau, fn)
                else:
                    pause = (tau, rows, fn)
            losses = self.inner.train(
                trained_round,
                lr_scale=lambda: self.lr_scale(trained_round),
                stop=self.stop,
                on_step=on_step,
                pause=pause,
                cut=self._budget_ran_out if self.group.leader else None,
                min_steps=1 if merge is None else merge[0],
            )
            self.placement.synchronize()
            inner_s = time.perf_counter() - t_inner - merging_s[0]
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
        steps, tokens = len(losses), len(losses) * self.tokens_per_step
        topk = self._agreed_topk()
        payload, recon = self._compress(trained_round, base, steps, tokens, topk)
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
            throughput=self.meter.measure(tokens, inner_s, self.steps),
            steps=steps,
            tokens=tokens,
            topk=topk,
        )

    def _budget_ran_out(self) -> bool:
        """(rank 0, between inner steps) Whether the round's training time is up."""
        cutoff = self.cutoff
        return cutoff is not None and self.cutoff_clock() >= cutoff

    def _agreed_topk(self) -> int:
        """The entries per tile this round sends: rank 0's plan (``send_topk``), the same on
        every rank, at most the run's k."""
        mine = self.send_topk if self.group.leader and self.send_topk else 0
        chosen = int(self.group.sum_ints(np.array([mine], dtype=np.int64), "agreeing on k")[0])
        return max(1, min(self.run.topk, chosen or self.run.topk))

    def _compress(
        self, round_: int, base: str, steps: int = 0, tokens: int = 0, topk: int | None = None
    ) -> tuple[bytes, dict[str, torch.Tensor]]:
        """Steps 4-5 on this rank's tensors, ``topk`` per tile, the work in the header; on a
        node of ranks, rank 0 assembles the payload from every rank's records
        (``node.compute.shards``; the others return no bytes)."""
        run = self.run
        topk = run.topk if topk is None else topk
        header = {"run_id": self.run_id, "node_id": self.node_id, "base": base}
        if not self.sharded:
            spare, self._spare_recon = self._spare_recon, None
            return compress(
                self.error, topk=topk, tile=run.tile, out=spare, round=round_,
                steps=steps, tokens=tokens, **header,
            )  # fmt: skip
        records, recon = encode_tensors(
            self.group, self.error, self.shapes, topk=topk, tile=run.tile
        )
        for name, e in self.error.items():
            e.sub_(recon[name])
        payload = node_payload(
            self.group, records, topk=topk, tile=run.tile, round_=round_, steps=steps,
            tokens=tokens, **header,
        )  # fmt: skip
        return payload, recon

    def _count_step(self) -> None:
        self.local_steps += 1
        self.steps.tick()
        if self.after_step is not None:
            now = time.perf_counter()
            self.after_step(now - self._step_started)
            self._step_started = time.perf_counter()

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
        the parameters being trained are the node's own and never leave it. On a node of
        several ranks each rank applies and steps its own tensors, and the step reaches every
        rank's FSDP chunks (``ShardedPlacement.shift``).
        """
        step = {n: p.clone() for n, p in self.params.items()}
        rejected = self.apply(payloads)
        with torch.no_grad():
            for n, p in self.params.items():
                step[n].sub_(p)  # θ_r - θ_{r+1}
        self.placement.shift(step)
        return rejected

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
        run = self.run
        options = AggregateOptions(run.alpha, run.clip, run.robust, combine=self.group.sum_ints)
        # Unequal work counts by the run's rule, from the steps the headers carry (the signed
        # manifest's sha256 binds every header, and each repeats the manifest's steps).
        steps = {n: p.steps for n, p in payloads.items()}
        work = peer_weights(steps, run.inner_steps, run.work_weight)
        if self.device.type == "cuda" and self.sharded:
            from node.compute import device

            screening = device.apply_aggregate(self.params, payloads, options, work)
        else:
            screening = apply_aggregate(self.params, payloads, options, work)
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
