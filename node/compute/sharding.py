"""Which rank of a node owns which of the model's tensors: the outer state's shards.

Each rank holds θ and the error-feedback buffer e only for the tensors it owns, runs the codec
on them, aggregates their part of every peer payload and saves them. The unit of ownership is
the **whole tensor**, chosen over row bands because everything the outer step computes per
tensor then stays inside one process with exactly a single process's arithmetic:

- the 2-bit quantiser's statistics (mean, σ and four levels over a tensor's kept values) and a
  payload record are per tensor: a rank encodes its tensors' records alone, and they are the
  very records a single process would write;
- median-norm clipping and the value bound use each peer's per-tensor norm: the owner computes
  it from that tensor's record alone;
- the fingerprint hashes tensor by tensor (``protocol.fingerprint``): a rank hashes its own.

Only robust screening's sign-agreement counts span tensors, and those are integers summed
exactly across the ranks (``Group.sum_ints``). So a node of any rank count applies bit for bit
what a single process applies, by construction rather than by careful reduction.

The price is balance: a tensor cannot be split, so a rank may hold more than 1/N. Tensors are
dealt largest first, each to the rank holding the fewest elements so far (ties: the lower rank;
then the name), which is within one tensor of the ideal. ``balance`` measures it; for the
presets the largest tensor is the embedding, a few percent of the model (docs/benchmarks.md §15
lists max/ideal per preset and rank count). The FSDP shards of the inner steps
(``node.compute.fsdp``) are FSDP's own dim-0 chunks, independent of this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


def assign(shapes: Mapping[str, tuple[int, ...]], world: int) -> dict[str, int]:
    """Tensor name -> the rank (0..world-1) that owns it; the same on every rank and machine."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    loads = [0] * world
    owner: dict[str, int] = {}
    for name in sorted(shapes, key=lambda n: (-math.prod(shapes[n]), n)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owner[name] = rank
        loads[rank] += math.prod(shapes[name])
    return owner


def owned(shapes: Mapping[str, tuple[int, ...]], world: int, rank: int) -> list[str]:
    """The tensors ``rank`` owns, in sorted name order."""
    owners = assign(shapes, world)
    return sorted(n for n, r in owners.items() if r == rank)


@dataclass(frozen=True)
class Balance:
    """How evenly ``assign`` spreads a model over ``world`` ranks."""

    world: int
    total: int
    #: Elements per rank.
    loads: tuple[int, ...]

    @property
    def largest_share(self) -> float:
        """The largest rank's fraction of the model (1/world at best)."""
        return max(self.loads) / self.total if self.total else 0.0

    @property
    def over_ideal(self) -> float:
        """The largest rank's load over the ideal ``total / world`` (1.0 at best)."""
        return self.largest_share * self.world


def balance(shapes: Mapping[str, tuple[int, ...]], world: int) -> Balance:
    owners = assign(shapes, world)
    loads = [0] * world
    for name, rank in owners.items():
        loads[rank] += math.prod(shapes[name])
    return Balance(world, sum(loads), tuple(loads))
