"""A round's time budget: by when, from its opening, every member should have submitted.

Participants differ 2-5x in speed. Without a budget a round closes when everyone it waits for
is in, so the slowest member sets the pace of the run (beside one node at 0.45x speed the
others trained 0.41 of the wall time, against 0.92 at equal speeds). With one, the coordinator
names in every round view how long the round may take (``RoundView.budget_s``, and
``budget_in_s`` left of it), and each node fits its work into it: it trains until H inner steps
or until the budget's end less its own encode, upload and margin, whichever comes first
(``node.compute.linkbudget``), and submits on time. A slower node then brings fewer steps, and
says so (its payload's and its submission's ``steps``); every node weighs the payloads by the
run's ``work_weight`` (``node.compute.work``).

The budget (``[run.timing] budget``):

- ``"median"``, the default: the time the median member needs for a whole round of H steps,
  end to end (from the round's opening to its payload's arrival: applying the previous round,
  training, encoding, uploading). Learnt from the recent rounds' accepted submissions: a
  member's whole-round time in a round is its arrival after the opening, scaled by H over the
  steps it carried (a member cut short would have needed that much longer), and its time is the
  median of those over the last ``HISTORY`` rounds it submitted to. The budget is the median of
  the members' times, plus ``SLACK`` of it (so that a member at that pace is not cut by its own
  round-to-round jitter) and ``MARGIN_S``. So half the members or more train whole rounds; the
  others bring what they can in the same time, and no one waits for them.
- ``"fastest"``: the same with the fastest member's time: everyone but the fastest is cut to
  what it trains in that time.
- a number: that many seconds, fixed.
- ``"off"``: no budget; every node trains H steps and the round waits for it, up to its deadline.

With no history yet (the run's first round, or after a run of empty rounds) there is no budget:
nodes train H steps, and the budget is learnt from that round on. The round's deadline
(``rounds.deadline_length``) is unchanged and remains what closes a round whose members are
late; the budget is what they aim at, and it is at most ``timing.max_round_s``.

Pure functions on plain values: ``tests/test_coordinator_budget.py`` checks them.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from protocol.runconfig import Timing
from protocol.work import claimed

#: Closed rounds whose submissions the budget learns from: few, so it follows a pace that
#: changed within a couple of rounds (and forgets the start-up of the first).
HISTORY = 3
#: Share of the learnt time added to the budget: a member at the budget's pace arrives within it
#: despite the jitter of its own rounds (and the node's own margin before the budget's end,
#: ``node.compute.linkbudget.MARGIN_SHARE``), so equal nodes are not cut by noise. Every bit
#: of it is time the members at that pace wait for one cut to arrive at the budget's end: 5 %
#: left the others 0.90-0.92 of their training share beside a node at a third of the speed,
#: 2.5 % 0.92-0.93 (docs/benchmarks.md §19), and a member cut by its jitter loses a step or
#: two, not time.
SLACK = 0.025
#: Seconds added to the budget besides (the same, for rounds of a few seconds).
MARGIN_S = 0.25

#: One accepted submission of a closed round: (node, seconds after the round's opening, steps).
Arrival = tuple[str, float, int | None]


def whole_round_s(after_s: float, steps: int | None, inner_steps: int) -> float:
    """A member's time for a whole round of H steps, from one round: its arrival after the
    opening, scaled by H over the steps it carried (unsaid, or more than H: H)."""
    return max(0.0, after_s) * inner_steps / claimed(steps, inner_steps)


def member_times(
    history: Sequence[Sequence[Arrival]], inner_steps: int, members: Iterable[str] | None = None
) -> dict[str, float]:
    """Each member's time for a whole round (the median of its recent rounds'), from the newest
    ``HISTORY`` rounds of ``history`` (oldest first); only ``members`` when given."""
    wanted = None if members is None else set(members)
    seen: dict[str, list[float]] = {}
    for arrivals in history[-HISTORY:]:
        for node, after, steps in arrivals:
            if wanted is None or node in wanted:
                seen.setdefault(node, []).append(whole_round_s(after, steps, inner_steps))
    return {node: statistics.median(times) for node, times in seen.items()}


def budget_s(
    history: Sequence[Sequence[Arrival]],
    timing: Timing,
    inner_steps: int,
    members: Iterable[str] | None = None,
) -> float | None:
    """Seconds the next round may take from its opening; None: no budget (train H steps)."""
    if timing.budget == "off":
        return None
    fixed = timing.fixed_budget_s
    if fixed is not None:
        return min(fixed, timing.max_round_s)
    times = member_times(history, inner_steps, members)
    if not times:
        return None
    pace = min(times.values()) if timing.budget == "fastest" else statistics.median(times.values())
    return min(timing.max_round_s, pace * (1.0 + SLACK) + MARGIN_S)
