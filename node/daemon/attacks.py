"""Hostile payloads, for the tests that check the honest nodes hold against them.

A node started with ``SPARSELOCO_ATTACK=<kind>`` follows the protocol in every other way (it
joins, uploads, submits with the right base fingerprint, reports) but replaces its honest
payload, every round, with one meant to hurt the model. Unset (always, outside the tests), it
costs nothing. Kinds:

- ``sign_flip``: its honest update with every sign flipped;
- ``noise``: Gaussian noise at the scale (RMS) of its honest error-feedback buffer;
- ``huge_tile``: the first 64 entries of every tensor at 10⁴ times that scale, against the
  honest sign; zeros elsewhere;
- ``one_entry``: the same with one entry per tensor;
- ``replay``: a peer's payload of the previous round, re-encoded as its own (a free rider);
- ``stale``: an honest update, but trained from θ of three rounds ago (claiming today's θ).

The payloads are well formed: the codec, the digests and the coordinator accept them. What
stops them is ``node.compute.robust`` on every honest node (or nothing needs to: a replay and
a stale update hurt less than leaving the node out, which the tests check).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from node.compute.worker import TrainResult, Worker
from protocol.codec import decode, encode
from protocol.errors import ConfigError

ENV = "SPARSELOCO_ATTACK"
KINDS = ("sign_flip", "noise", "huge_tile", "one_entry", "replay", "stale")
#: How far back ``stale`` trains from, in rounds.
STALE_ROUNDS = 3
#: Magnitude of the ``huge_tile`` and ``one_entry`` entries, in RMS of the honest buffer.
HUGE = 1e4


@dataclass
class Attack:
    kind: str
    seed: int = 0
    #: ``replay``: the previous round's gathered payloads, by node id.
    previous: dict[str, bytes] = field(default_factory=dict)
    #: ``stale``: θ at the start of recent rounds, oldest first.
    history: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def from_env(cls) -> Attack | None:
        kind = os.environ.get(ENV)
        if not kind:
            return None
        if kind not in KINDS:
            raise ConfigError(f"{ENV}={kind!r}: use one of {', '.join(KINDS)}")
        return cls(kind)

    def remember(self, blobs: Mapping[str, bytes]) -> None:
        """A round's gathered payloads (what ``replay`` copies from next round)."""
        self.previous = dict(blobs)

    def train(
        self,
        worker: Worker,
        round_: int | None = None,
        offset: Mapping[str, torch.Tensor] | None = None,
    ) -> TrainResult:
        """(compute thread) This round's payload, made hostile (the arguments are
        ``Worker.train_and_compress``'s)."""
        if self.kind == "stale":
            return self._stale(worker, round_, offset)
        honest = worker.train_and_compress(round_, offset)
        before = {n: worker.error[n] + honest.recon[n] for n in honest.recon}  # β·e + Δ
        hostile = self._hostile(worker, honest, before)
        if hostile is None:
            return honest
        # The attacker keeps its own error feedback honest (``recon`` stays the honest ĉ), so its
        # buffer stays sane round after round while it sends something else.
        data, _ = encode(
            hostile,
            topk=worker.run.topk,
            tile=worker.run.tile,
            run_id=worker.run_id,
            round=worker.round if round_ is None else round_,
            node_id=worker.node_id,
            base=honest.base,
        )
        return replace(honest, payload=data, sha256=hashlib.sha256(data).hexdigest())

    def _hostile(
        self, worker: Worker, honest: TrainResult, before: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        previous = None
        if self.kind == "replay":
            peers = sorted(n for n in self.previous if n != worker.node_id)
            if not peers:
                return None  # nothing to copy yet: send the honest payload this once
            previous = decode(self.previous[peers[0]], worker.shapes)
        return hostile_tensors(
            self.kind, honest.recon, before, seed=self.seed * 1_000_003 + worker.round,
            previous=previous,
        )  # fmt: skip

    def _stale(
        self, worker: Worker, round_: int | None, offset: Mapping[str, torch.Tensor] | None
    ) -> TrainResult:
        now = {n: t.clone() for n, t in worker.params.items()}
        self.history.append(now)
        del self.history[: -(STALE_ROUNDS + 1)]
        old = self.history[0]
        base = worker.fingerprint()
        if old is now:
            return worker.train_and_compress(round_, offset)
        worker.reset_theta(old)
        try:
            result = worker.train_and_compress(round_, offset)
        finally:
            worker.reset_theta(now, base)
        return replace(result, base=base)  # it claims today's θ


def hostile_tensors(
    kind: str,
    recon: Mapping[str, torch.Tensor],
    before: Mapping[str, torch.Tensor],
    *,
    seed: int,
    previous: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """What a hostile node encodes instead of its honest update ``recon`` (ĉ), given its
    error-feedback buffer ``before`` compression and, for ``replay``, a peer's ``previous``
    update (dense). ``stale`` changes the training, not the tensors: not handled here."""
    rms = {n: float(t.pow(2).mean().sqrt()) + 1e-12 for n, t in before.items()}
    if kind == "sign_flip":
        return {n: -t for n, t in recon.items()}
    if kind == "noise":
        g = torch.Generator().manual_seed(seed)
        return {n: torch.randn(t.shape, generator=g) * rms[n] for n, t in before.items()}
    if kind in ("huge_tile", "one_entry"):
        width = 64 if kind == "huge_tile" else 1
        out = {}
        for n, t in before.items():
            flat = t.reshape(-1)
            a = torch.zeros_like(flat)
            m = min(width, flat.numel())
            sign = torch.where(flat[:m] >= 0, 1.0, -1.0)
            a[:m] = -sign * HUGE * rms[n]
            out[n] = a.view(t.shape)
        return out
    if kind == "replay" and previous is not None:
        return {n: t.clone() for n, t in previous.items()}
    raise ConfigError(f"{ENV}: no tensors for attack {kind!r}")
