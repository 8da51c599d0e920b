"""What a hostile participant sends instead of its honest update: the attacks' tensors.

Research code: ``sparseloco bench robust`` (``node.research.bench.robust_bench``) simulates
attackers with it, and the tests' hostile node processes (``tests/support/hostile.py``, which
wrap the real daemon at its seams) encode the same tensors. The node daemon never imports it.
Kinds:

- ``sign_flip``: the honest update with every sign flipped;
- ``noise``: Gaussian noise at the scale (RMS) of the honest error-feedback buffer;
- ``huge_tile``: the first 64 entries of every tensor at 10⁴ times that scale, against the
  honest sign; zeros elsewhere;
- ``one_entry``: the same with one entry per tensor;
- ``replay``: a peer's payload of the previous round, re-encoded as its own (a free rider);
- ``stale``: an honest update, but trained from θ of ``STALE_ROUNDS`` rounds ago (claiming
  today's θ): it changes the training, not the tensors, so ``hostile_tensors`` has no case
  for it.

Encoded, each is a well-formed payload: the codec, the digests and the coordinator accept it.
What stops them is ``node.compute.robust`` on every honest node (or nothing needs to: a replay
and a stale update hurt less than leaving the node out).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from protocol.errors import ConfigError

KINDS = ("sign_flip", "noise", "huge_tile", "one_entry", "replay", "stale")
#: How far back ``stale`` trains from, in rounds.
STALE_ROUNDS = 3
#: Magnitude of the ``huge_tile`` and ``one_entry`` entries, in RMS of the honest buffer.
HUGE = 1e4


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
    raise ConfigError(f"no tensors for attack {kind!r} (one of {', '.join(KINDS)})")
