"""The round rules as pure functions: no clock, no database, no network.

Everything the coordinator decides about a round is computed here from plain values, so it can
be tested exhaustively (``tests/test_coordinator_rounds.py``) and read in one place:

- the round in progress, as nodes and dashboards see it (the run's length once it finished);
- who is expected to submit to round r (active members that joined at or before r), and who of
  them the round waits for (not those silent for the run's ``silent_rounds`` rounds in a row);
- the round a (re)joining member first takes part in;
- when an open round closes (all expected submitted, or the deadline passed), and when a round
  with nothing to aggregate is held open past its deadline instead (``is_held``), and for how
  long it then waits for the others once its first valid submission came (``gather_window``);
- the base fingerprint a round's payloads must have been trained from (a majority vote);
- the gather set (at most G valid submissions, first come first served) and every exclusion;
- the adaptive deadline (a multiple of recent round durations plus a margin, clamped), learnt
  from when each round's last valid submission arrived, not from when a silent member let it
  run into its deadline.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from protocol.messages import Exclusion, MemberState, NodeCondition, RoundState
from protocol.runconfig import Timing

#: Closed rounds whose durations set the next deadline.
DEADLINE_HISTORY = 5
#: What a member's heartbeat may say that keeps a round with no valid submission open past its
#: deadline: it is working toward its payload, or it cannot reach the store to deliver it.
BUSY = frozenset({NodeCondition.TRAINING, NodeCondition.STORE_UNREACHABLE})
#: Share of the time a held round's first valid submission took (from the round's start) that
#: the others get after it, at least (``gather_window``): nodes slowed alike arrive alike late.
LATE_SHARE = 0.5


@dataclass(frozen=True)
class Member:
    node_id: str
    state: MemberState
    joined_round: int
    #: The round that was current when the member left or timed out (``None`` while active).
    gone_in_round: int | None = None


@dataclass(frozen=True)
class Submission:
    """One node's submission to a round, as recorded on arrival."""

    node_id: str
    seq: int  # arrival order within the round, 0-based
    sha256: str
    size: int
    base_fingerprint: str
    rejected: Exclusion | None = None  # decided on arrival (bad digest, known wrong base)
    #: The work the payload carries, as submitted (None: not said).
    steps: int | None = None
    tokens: int | None = None


@dataclass(frozen=True)
class CloseDecision:
    """What closing a round decides: the gather set (sorted by node id) and the exclusions."""

    base_fingerprint: str | None
    gather: tuple[Submission, ...]
    excluded: Mapping[str, Exclusion]


def in_progress(newest: int, state: RoundState, total_rounds: int) -> tuple[int, RoundState]:
    """The round in progress and its state, from the newest round and its state.

    The newest round is in progress until it closes; a closed newest round means the run's last
    round closed, so the run shows as round ``total_rounds`` in state ``finished``.
    """
    if state == RoundState.CLOSED:
        return total_rounds, RoundState.FINISHED
    return newest, state


def is_expected(member: Member, round_: int) -> bool:
    """Whether ``member`` must submit to ``round_`` before it can close early."""
    return member.state == MemberState.ACTIVE and member.joined_round <= round_


def expected_set(members: Iterable[Member], round_: int) -> set[str]:
    return {m.node_id for m in members if is_expected(m, round_)}


def is_silent(member: Member, round_: int, recent_submitters: set[str], silent_rounds: int) -> bool:
    """Whether ``member`` submitted nothing in each of the ``silent_rounds`` rounds before
    ``round_``, all of them rounds it was expected in (``recent_submitters``: who submitted
    anything, even a rejected payload, to one of those rounds)."""
    return member.joined_round <= round_ - silent_rounds and member.node_id not in recent_submitters


def waited_set(
    members: Iterable[Member], round_: int, recent_submitters: set[str], silent_rounds: int
) -> set[str]:
    """The expected members ``round_`` waits for before it may close early.

    A silent member (``is_silent``) stays a member and may still submit, but the round no longer
    waits for it: one member that heartbeats and never submits costs at most ``silent_rounds``
    deadline waits, not one per round. Its next submission puts it back from the round after.
    If every expected member is silent, the round waits for all of them (until the deadline), so
    a round never closes at once with nobody in it.
    """
    expected = [m for m in members if is_expected(m, round_)]
    waited = {
        m.node_id for m in expected if not is_silent(m, round_, recent_submitters, silent_rounds)
    }
    return waited or {m.node_id for m in expected}


def joined_round_for(state: RoundState, round_: int, has_submissions: bool) -> int:
    """The first round a member joining now takes part in.

    It can still take part in the current round while nothing has happened in it that it missed:
    the round is waiting, or open with no submission yet. Otherwise it starts with the next one.
    """
    if state == RoundState.WAITING or (state == RoundState.OPEN and not has_submissions):
        return round_
    return round_ + 1


def should_close(expected: set[str], submitted: Iterable[str], now: float, deadline: float) -> bool:
    """An open round closes once every expected member submitted, or at its deadline."""
    return now >= deadline or expected <= set(submitted)


def majority(values: Iterable[str]) -> str | None:
    """The most frequent value; ties go to the smallest string; ``None`` for no values."""
    return majority_of(Counter(values))


def majority_of(counts: Mapping[str, int]) -> str | None:
    """``majority`` of values already counted (value -> how often; zero counts ignored)."""
    present = [v for v, n in counts.items() if n > 0]
    if not present:
        return None
    return min(present, key=lambda v: (-counts[v], v))


def base_fingerprint(reported: Sequence[str], submissions: Iterable[Submission]) -> str | None:
    """The fingerprint of θ_r the round's payloads must be trained from.

    The nodes' reports of the fingerprint after applying round r-1 win when there are any;
    otherwise (round 0, or nobody reported) the majority of the submissions not already rejected.
    """
    if reported:
        return majority(reported)
    return majority(s.base_fingerprint for s in submissions if s.rejected is None)


def decide_close(
    submissions: Sequence[Submission],
    members: Iterable[Member],
    round_: int,
    reported: Sequence[str],
    gather_size: int,
) -> CloseDecision:
    """Gather at most ``gather_size`` valid submissions in arrival order; say why others are out.

    Valid: not rejected on arrival, and trained from the round's base fingerprint. Expected
    members without a submission are excluded as missed deadline, left, timed out or revoked.
    """
    if gather_size < 1:
        raise ValueError(f"gather_size must be >= 1, got {gather_size}")
    base = base_fingerprint(reported, submissions)
    excluded: dict[str, Exclusion] = {}
    gather: list[Submission] = []
    for sub in sorted(submissions, key=lambda s: (s.seq, s.node_id)):
        if sub.rejected is not None:
            excluded[sub.node_id] = sub.rejected
        elif sub.base_fingerprint != base:
            excluded[sub.node_id] = Exclusion.WRONG_BASE
        elif len(gather) < gather_size:
            gather.append(sub)
        else:
            excluded[sub.node_id] = Exclusion.OVER_LIMIT
    submitted = {s.node_id for s in submissions}
    for member in members:
        if member.joined_round > round_ or member.node_id in submitted:
            continue
        # A member that left or timed out is named only if it went during this round; one that
        # was gone before is not worth a line in every later manifest.
        if member.state == MemberState.ACTIVE or member.gone_in_round == round_:
            excluded[member.node_id] = absent_reason(member.state)
    gather.sort(key=lambda s: s.node_id)
    return CloseDecision(base_fingerprint=base, gather=tuple(gather), excluded=excluded)


def absent_reason(state: MemberState) -> Exclusion:
    """Why an expected member without a submission is excluded."""
    if state == MemberState.LEFT:
        return Exclusion.LEFT
    if state == MemberState.TIMED_OUT:
        return Exclusion.TIMED_OUT
    if state == MemberState.REVOKED:
        return Exclusion.REVOKED
    return Exclusion.MISSED_DEADLINE


def settled_at(
    decision: CloseDecision, submitted_at: Mapping[str, float | None], closed_at: float
) -> float:
    """When a closing round's work was in: the arrival of its last valid submission (gathered,
    or over the gather limit), else its close. This, not the close, is what its duration adds
    to the deadline history, so a round that ran into its deadline waiting for a silent member
    does not lengthen the next deadlines; a round with no valid submission counts in full (the
    deadline may be too short for everyone)."""
    valid = [s.node_id for s in decision.gather]
    valid += [n for n, why in decision.excluded.items() if why == Exclusion.OVER_LIMIT]
    times = [t for t in (submitted_at.get(n) for n in valid) if t is not None]
    return min(closed_at, max(times)) if times else closed_at


def deadline_length(durations: Sequence[float], timing: Timing) -> float:
    """Seconds a new round may stay open.

    ``durations`` are the closed rounds' durations, oldest first. With none, the first-round
    allowance; else ``factor`` x the median of the last few plus ``margin_s``, clamped.
    """
    if not durations:
        return timing.first_round_s
    recent = durations[-DEADLINE_HISTORY:]
    raw = timing.factor * statistics.median(recent) + timing.margin_s
    return min(timing.max_round_s, max(timing.min_round_s, raw))


def is_busy(
    condition: NodeCondition | None, said_at: float = 0.0, opened_at: float | None = None
) -> bool:
    """Whether a member that said ``condition`` at ``said_at`` may still submit to the round it
    is expected in, opened at ``opened_at``. A member that said it was waiting before the round
    opened was waiting for the previous round to close: it has been at work since."""
    if condition in BUSY:
        return True
    return condition == NodeCondition.WAITING and opened_at is not None and said_at < opened_at


def is_held(has_valid: bool, busy: Iterable[str]) -> bool:
    """Whether an open round whose deadline passed stays open.

    A round with no valid submission would close with an empty gather set: nothing aggregated,
    and one of the run's rounds spent. It stays open while a member it expects is alive and
    busy (training, or cut off from the store); it closes as before once none is (they left,
    timed out, or wait after a payload that was refused). A round with a valid submission is
    never held: a member that says "training" forever cannot delay a round others delivered
    to, only a run in which nobody delivers anything.
    """
    return not has_valid and any(True for _ in busy)


def gather_window(spreads: Sequence[float], first_after_s: float, timing: Timing) -> float:
    """Seconds a held round stays open after its first valid submission, for the others.

    ``spreads`` are recent closed rounds' times from their first to their last valid arrival
    (oldest first); ``first_after_s`` is how long after the round's start that first one came.
    The window is the larger of ``factor`` x the median spread plus ``margin_s`` (how far apart
    nodes usually arrive) and ``LATE_SHARE`` of ``first_after_s`` (nodes slowed alike arrive
    that much further apart), at most ``max_round_s``. It still ends early once every member
    the round waits for is in (``should_close``).
    """
    recent = spreads[-DEADLINE_HISTORY:]
    learnt = timing.factor * statistics.median(recent) if recent else 0.0
    window = max(learnt + timing.margin_s, LATE_SHARE * max(0.0, first_after_s))
    return min(timing.max_round_s, window)


def paused_by(outage_from: float, started_at: float, now: float) -> float:
    """Seconds a round started at ``started_at`` lost to an outage from ``outage_from`` to
    ``now``: its deadline moves that much later."""
    return max(0.0, now - max(outage_from, started_at))
