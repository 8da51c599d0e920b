"""Aggregating unequal work: how much a peer's payload counts when peers trained unequal steps.

Participants differ 2-5x in speed, and a round has a time budget (``coordinator.rules.budget``):
a slower node trains fewer than H inner steps and submits on time. Its payload says how many it
trained (the payload's ``steps``, which the signed manifest repeats), and every node weighs the
peers by the same rule (the run's ``work_weight``), so θ stays bit-identical:

- ``"mean"``: the contributor mean as without budgets (what the production SparseLoCo run,
  Templar, does with a payload cut short by its window): every payload counts once. A node
  that took a third of the steps pulls each entry it selected towards its smaller update.
- ``"steps"``: the contributor mean weighted by steps: per entry, Σ s_p·v_p / Σ s_p over the
  peers that selected it. A payload of a third of the steps counts a third. Integers in the
  denominator (``PeerWeight.post``), one fp32 multiplication per value, so every node forms
  the same sums; equal steps give weight 1 everywhere, bit for bit the plain mean.
- ``"per_step"``: each payload scaled by H / s_p before clipping (FedNova's normalisation of
  unequal local steps to a per-step update at the round's length), then the plain mean.

Which rule a run uses is measured (docs/benchmarks.md §18: the simulator's ablation at equal
wall time on two speed mixes, two models and three seeds): ``DEFAULT_RULE``, ``steps``, was the
best or within 0.4 % of the best in all eight cells and never the worst; ``mean`` was behind it
in six, ``per_step`` the least stable (a payload of few steps scaled up carries its noise up).

**What a claim can buy.** ``steps`` is the node's own word (the coordinator records what it
submits; nothing can check the inner steps of another machine). So claims are clamped to
[1, H] before any rule sees them (``protocol.work.claimed``), and each rule bounds the rest:

- ``"steps"``: the most a claim can buy is H, an honest full node's weight, which is every
  node's weight under ``"mean"``: a node that ran one step and claims H gains no more than the
  plain mean already gave it, and a claim of more than H buys nothing more. Its values still
  pass median-norm clipping and the value bound like anyone's.
- ``"per_step"``: a claim of fewer steps than taken scales a payload up by up to H; the
  median-norm clipping sees the scaled norm (``PeerWeight.pre`` comes first), so it still
  ends at most at the median norm of the round's peers. (Without ``clip`` nothing bounds it:
  the run's config refuses ``per_step`` without ``clip``.)

Screening (``node.compute.robust``) looks at signs only, never at a payload's norm or work, so
an honest node that did less is judged by its direction like any other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import get_args

from protocol.runconfig import RunConfig, WorkRule
from protocol.work import claimed, work_shares

__all__ = ["DEFAULT_RULE", "RULES", "UNIT", "PeerWeight", "claimed", "peer_weights", "work_shares"]

RULES: tuple[WorkRule, ...] = get_args(WorkRule)
#: The rule a run uses unless its config names another (docs/benchmarks.md §18).
DEFAULT_RULE: WorkRule = RunConfig.model_fields["work_weight"].default
#: Largest integer weight: keeps Σ weights of a round's peers per entry far inside int32.
MAX_WEIGHT = 1 << 16


@dataclass(frozen=True)
class PeerWeight:
    """How one peer's payload counts: its values are multiplied by ``pre`` before clipping and
    by ``post`` after it, and it counts ``post`` times in each entry's denominator."""

    pre: float = 1.0
    post: int = 1


#: Every peer counts once.
UNIT = PeerWeight()


def peer_weights(
    steps: Mapping[str, int | None], inner_steps: int, rule: WorkRule
) -> dict[str, PeerWeight] | None:
    """Each peer's ``PeerWeight`` under ``rule``, from the steps its payload carries (node id ->
    steps, as the manifest lists them); None when every peer counts once (the plain mean: equal
    work, or the ``"mean"`` rule), so the aggregation takes its unweighted path."""
    if rule not in RULES:
        raise ValueError(f"unknown work rule {rule!r}; choose one of {', '.join(RULES)}")
    taken = {n: claimed(s, inner_steps) for n, s in steps.items()}
    if rule == "mean" or len(set(taken.values())) <= 1:
        return None
    if rule == "per_step":
        return {n: PeerWeight(pre=inner_steps / s) for n, s in taken.items()}
    if inner_steps > MAX_WEIGHT:  # quantised to MAX_WEIGHT levels, still at least 1
        taken = {n: max(1, s * MAX_WEIGHT // inner_steps) for n, s in taken.items()}
    common = math.gcd(*taken.values())
    return {n: PeerWeight(post=s // common) for n, s in taken.items()}
