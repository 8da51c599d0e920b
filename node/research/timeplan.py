"""The simulator's model of time for unequal workers: who trains how much in a round.

Time is counted in *step units*, one inner step of a speed-1 worker. Worker w has a relative
speed v_w and a round's transfers take it t_w (not overlapping its training), so a whole round
of H steps takes it f_w = H/v_w + t_w. A round's ``Schedule`` says how it treats the
differences (``plan_round``):

- ``wait``: every worker trains H steps and the round waits for the slowest (the behaviour
  before time budgets);
- ``leave_out``: a worker with f_w over the budget B sits the round out;
- ``budget``: worker w trains min(H, floor((B - t_w) v_w)) steps, at least one, and its
  payload says so (what the nodes do: ``node.compute.linkbudget``);
- ``batch``: every worker trains H steps of fewer rows, its step time proportional to its
  rows (the alternative the issue named: H fixed, the batch scaled to the throughput).

B is ``round_budget`` of the f_w (the run's ``timing.budget``: the median, as the coordinator
learns it, the fastest, off, or a number of step units). The plan is the same every round,
so a run of wall time W is ``RoundPlan.rounds_in(W)`` rounds. Pure arithmetic, tested in
``tests/test_simulate.py``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from protocol.runconfig import Budget

#: How a round treats unequal workers (``plan_round``).
Schedule = Literal["wait", "leave_out", "budget", "batch"]

#: Slack of the time model's floors and comparisons, so that float rounding never costs a step
#: (30 × (1/3) is 10 steps, not 9).
_SLACK = 1e-9


@dataclass(frozen=True)
class RoundPlan:
    """What each worker does in a round under the model of time (the same every round).

    Times are in step units. Worker w trains ``steps[w]`` inner steps (0: it sits the round
    out) of ``rows[w]`` rows each, and its payload says it carries ``work[w]`` steps: the steps
    it trained, except under ``batch``, where a step of fewer rows counts as that share of a
    full-batch step (``work_weight`` weighs payloads by this). ``budget`` is B, ``wall`` the
    round's wall time (its slowest participant's)."""

    budget: float
    steps: tuple[int, ...]
    rows: tuple[int, ...]
    work: tuple[int, ...]
    wall: float

    def rounds_in(self, wall: float) -> int:
        """Whole rounds that fit in ``wall`` step units (at least one)."""
        return max(1, math.floor(wall / self.wall + _SLACK))


def round_budget(full: Sequence[float], budget: Budget) -> float:
    """B, in step units, from the workers' full-round times f_w: "median" is
    ``statistics.median`` (the mean of the middle two for an even count, as the coordinator's
    budget); "fastest" the least; "off" the most (nobody is cut); a number is that many units."""
    if budget == "median":
        return float(statistics.median(full))
    if budget == "fastest":
        return min(full)
    if budget == "off":
        return max(full)
    return float(budget)


def plan_round(
    *,
    inner_steps: int,
    batch_size: int,
    speeds: Sequence[float],
    link: Sequence[float],
    schedule: Schedule,
    budget: Budget,
) -> RoundPlan:
    """Every worker's steps, rows and work in one round, and the round's wall time (see the
    module docstring). Raises ``ValueError`` when a budget leaves every worker out."""
    H, n = inner_steps, len(speeds)
    full = [H / v + t for v, t in zip(speeds, link, strict=True)]
    whole = (batch_size,) * n
    if schedule == "wait":
        return RoundPlan(max(full), (H,) * n, whole, (H,) * n, max(full))
    B = round_budget(full, budget)
    if schedule == "leave_out":
        steps = tuple(H if f <= B + _SLACK else 0 for f in full)
        if not any(steps):
            raise ValueError(
                f"a budget of {B:g} step units leaves every worker out (the fastest needs"
                f" {min(full):g}); raise --budget or use --budget median"
            )
        return RoundPlan(
            B, steps, whole, steps, max(f for f, s in zip(full, steps, strict=True) if s)
        )
    if schedule == "budget":
        steps = tuple(
            min(H, max(1, _floor((B - t) * v))) for v, t in zip(speeds, link, strict=True)
        )
        wall = max(s / v + t for s, v, t in zip(steps, speeds, link, strict=True))
        return RoundPlan(B, steps, whole, steps, wall)
    rows = tuple(
        min(batch_size, max(1, _floor(batch_size * v * (B - t) / H)))
        for v, t in zip(speeds, link, strict=True)
    )
    wall = max(H * (b / batch_size) / v + t for b, v, t in zip(rows, speeds, link, strict=True))
    work = tuple(max(1, round(H * b / batch_size)) for b in rows)
    return RoundPlan(B, (H,) * n, rows, work, wall)


def _floor(x: float) -> int:
    return math.floor(x + _SLACK)
