"""The work a payload carries, as both sides read it: a claim of inner steps, clamped.

A payload's ``steps`` (its header, its submission, the signed manifest) is its node's word:
nothing can check the inner steps another machine trained. Everything that reads a claim (the
aggregation's weights, ``node.compute.work``; the coordinator's time budget,
``coordinator.rules.budget``; the status' shares of the work) reads it through ``claimed``:
clamped to [1, H], unsaid as H. So no claim buys more than a whole round's weight, and both
sides agree on what a claim counts for.
"""

from __future__ import annotations

from collections.abc import Mapping


def claimed(steps: int | None, inner_steps: int) -> int:
    """A payload's steps as they count: clamped to [1, H]; unsaid (None, 0) is H."""
    if not steps:
        return inner_steps
    return max(1, min(inner_steps, steps))


def work_shares(steps: Mapping[str, int | None], inner_steps: int) -> dict[str, float]:
    """Each peer's share of the round's work (its claimed steps over everyone's)."""
    taken = {n: claimed(s, inner_steps) for n, s in steps.items()}
    total = sum(taken.values())
    return {n: s / total for n, s in taken.items()} if total else {}
