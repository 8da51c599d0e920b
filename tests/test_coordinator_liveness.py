"""Liveness against insiders, and votes only from participants: the round rules and machine.

- A member that heartbeats but never submits is waited for in at most ``timing.silent_rounds``
  rounds; after that rounds close as soon as the others are in, and it is back (waited for)
  from the round after its next submission. If every member is silent, rounds still wait.
- Deadlines learn from when a round's last valid submission arrived, not from a deadline close
  a silent member caused: they do not grow while it stays silent.
- Only a round's participants report on it, and only their reports make the base fingerprint.

``RoundMachine`` on a real SQLite file, a hand-driven clock, no network (the pattern of
``test_coordinator_rounds.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.base.errors import Conflict
from coordinator.rules import rounds
from coordinator.rules.machine import RoundMachine
from coordinator.state.db import Database
from coordinator.state.signing import ManifestSigner
from protocol.messages import Exclusion, MemberState, NodeCondition, RoundState, SubmitRequest
from protocol.reports import RoundReport
from protocol.runconfig import RunConfig, Timing

FP = "a" * 32
OTHER = "0" * 32  # sorts first: it would win a tie
TIMING = Timing(
    first_round_s=100,
    min_round_s=10,
    max_round_s=1000,
    factor=2,
    margin_s=10,
    heartbeat_timeout_s=1e9,
    silent_rounds=2,
)


class Clock:
    """The machine's wall clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Bench:
    """A machine, its clock and what each closed round looked like."""

    machine: RoundMachine
    clock: Clock
    closed_by: dict[int, str] = field(default_factory=dict)  # round -> "quorum" | "deadline"
    allowed: dict[int, float] = field(default_factory=dict)  # round -> deadline length

    @property
    def now(self) -> float:
        return self.clock.now

    @now.setter
    def now(self, value: float) -> None:
        self.clock.now = value

    def open_round(self) -> int:
        row = self.machine.db.current_round()
        assert row is not None and row.state == RoundState.OPEN
        assert row.deadline is not None and row.started_at is not None
        self.allowed[row.round] = row.deadline - row.started_at
        return row.round

    def submit(self, node: str, round_: int) -> bool:
        """``node`` submits to ``round_``; whether that closed the round."""
        req = SubmitRequest(size=1, sha256="0" * 64, base_fingerprint=FP)
        resp, closed = self.machine.submit(node, round_, req, True)
        assert resp.accepted, resp
        if closed:
            self.closed_by[round_] = "quorum"
        return bool(closed)

    def run_out(self, round_: int) -> None:
        """Time passes until ``round_``'s deadline; a tick closes it."""
        row = self.machine.db.get_round(round_)
        assert row is not None and row.deadline is not None
        self.now = row.deadline
        assert [m.manifest.round for m in self.machine.tick()] == [round_]
        self.closed_by[round_] = "deadline"


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    db = Database(tmp_path / "db.sqlite")
    clock = Clock()
    run = RunConfig(rounds=14, min_nodes=3, timing=TIMING)
    machine = RoundMachine(db, run, ManifestSigner.load_or_create(tmp_path), clock=clock)
    yield Bench(machine, clock)
    db.close()


def play(bench: Bench, round_: int, submitters: list[str], heartbeats: list[str]) -> None:
    """Honest nodes submit 5 s into the round; if that does not close it, its deadline does."""
    bench.now += 5
    for node in heartbeats:
        bench.machine.heartbeat(node)
    closed = False
    for node in submitters:
        closed = bench.submit(node, round_)
    if not closed:
        bench.run_out(round_)


def test_a_silent_member_costs_at_most_n_deadline_waits(bench: Bench) -> None:
    for node in ("a", "b", "silent"):
        bench.machine.join(node)
    n = TIMING.silent_rounds
    for _ in range(10):
        r = bench.open_round()
        play(bench, r, ["a", "b"], heartbeats=["a", "b", "silent"])
        manifest = bench.machine.manifest(r)
        assert manifest is not None
        assert manifest.manifest.excluded == {"silent": Exclusion.MISSED_DEADLINE.value}
    waits = [r for r, how in bench.closed_by.items() if how == "deadline"]
    assert waits == list(range(n)), bench.closed_by  # the first N rounds only
    assert all(bench.closed_by[r] == "quorum" for r in range(n, 10))
    # Round 0 had the first-round allowance; later deadlines come from the honest arrivals
    # (5 s): 2 x 5 + 10 = 20 s, and they never grow while the silent member stays silent.
    assert bench.allowed[0] == TIMING.first_round_s
    assert {bench.allowed[r] for r in range(1, 10)} == {20.0}
    # Still a member all along: dropped from the waited set, not from the run.
    silent = bench.machine.db.member("silent")
    assert silent is not None and silent.state == MemberState.ACTIVE
    assert bench.machine.round_view("silent").expected  # it may still take part


def test_a_silent_member_is_waited_for_again_after_it_submits(bench: Bench) -> None:
    for node in ("a", "b", "silent"):
        bench.machine.join(node)
    for _ in range(3):
        play(bench, bench.open_round(), ["a", "b"], heartbeats=["silent"])
    assert bench.closed_by[2] == "quorum"  # dropped by now
    r = bench.open_round()
    bench.now += 1
    assert not bench.submit("silent", r)  # it submits again (in time)...
    bench.now += 4
    assert not bench.submit("a", r)
    assert bench.submit("b", r)  # ...this round still closes by the others' quorum
    gathered = bench.machine.manifest(r)
    assert gathered is not None and "silent" in {e.node_id for e in gathered.manifest.gather}
    r = bench.open_round()  # ...and from the next round it is waited for again
    bench.now += 5
    assert not bench.submit("a", r)
    assert not bench.submit("b", r)
    assert bench.machine.waited(r) == {"a", "b", "silent"}
    bench.now += 1
    assert bench.submit("silent", r)
    assert bench.closed_by[r] == "quorum"


def test_a_straggler_that_keeps_coming_late_gets_back_in(bench: Bench) -> None:
    """A node stalls once for 50 s, in round 2. It misses that round and the next, so it is
    silent by the rule above; and it starts each round when it has finished being late for
    the previous one. Without more, a round that closes the moment the others are in would
    leave it late for good. Each round it came late to gives it a grace once the others are in,
    so it gets back in and stays."""
    for node in ("a", "b", "slow"):
        bench.machine.join(node)
    stall = {2: 50.0}
    behind = 0.0  # seconds "slow" starts a round after the others
    gathered = []
    for _ in range(12):
        r = bench.open_round()
        start = bench.now
        slow_at = start + 5 + behind + stall.get(r, 0.0)
        bench.now = start + 5
        closed = bench.submit("a", r) or bench.submit("b", r)
        while not closed:  # a second at a time: the straggler arrives, or a tick closes it
            bench.now += 1
            arrived = bench.now >= slow_at
            closed = bench.submit("slow", r) if arrived else bool(bench.machine.tick())
        manifest = bench.machine.manifest(r)
        assert manifest is not None
        if "slow" in {e.node_id for e in manifest.manifest.gather}:
            gathered.append(r)
            behind = 0.0
        else:
            with pytest.raises(Conflict, match="not open for submissions"):  # after the close
                bench.machine.check_submittable("slow", r)
            behind = max(0.0, slow_at - bench.now)
    assert 2 not in gathered and 3 not in gathered  # it did miss those
    assert gathered[:2] == [0, 1] and gathered[2:] == list(range(gathered[2], 12))
    # Each grace (a quarter of the deadline length) takes seconds off its lag until it is in.
    assert gathered[2] <= 7, gathered


def test_a_member_that_never_tries_gets_no_grace(bench: Bench) -> None:
    for node in ("a", "b", "silent"):
        bench.machine.join(node)
    for _ in range(4):
        play(bench, bench.open_round(), ["a", "b"], heartbeats=["silent"])
    assert [bench.closed_by[r] for r in range(4)] == ["deadline", "deadline", "quorum", "quorum"]
    r = bench.open_round()
    bench.now += 5
    bench.submit("a", r)
    assert bench.submit("b", r)  # closed the moment the others were in: no grace to wait


def test_when_everyone_is_silent_rounds_still_wait_for_their_deadline(bench: Bench) -> None:
    for node in ("a", "b", "c"):
        bench.machine.join(node)
    for _ in range(4):
        r = bench.open_round()
        row = bench.machine.db.get_round(r)
        assert row is not None and row.deadline is not None
        bench.now = row.deadline - 1
        for node in ("a", "b", "c"):
            # Not training: a member at work holds a round nobody submitted to past its
            # deadline (test_coordinator_holds.py); these only wait.
            bench.machine.heartbeat(node, NodeCondition.WAITING)
        assert bench.machine.tick() == []  # nobody is waited for: it does not close at once
        bench.run_out(r)
    # No valid submission: the whole duration counts, so a deadline too short for everyone
    # still grows (100 -> 2 x 100 + 10 -> ...).
    assert bench.allowed[1] == 210.0 and bench.allowed[2] > bench.allowed[1]


def test_only_participants_report_and_vote(bench: Bench) -> None:
    for node in ("a", "b", "c"):
        bench.machine.join(node)
    play(bench, 0, ["a", "b", "c"], heartbeats=[])
    bench.machine.join("late")  # joined after round 0: took no part in it
    for node, code in (("late", "not_member"), ("stranger", "not_member")):
        with pytest.raises(Conflict) as refused:
            bench.machine.report(node, 0, RoundReport(fingerprint=OTHER))
        assert refused.value.code == code
    assert bench.machine.report("a", 0, RoundReport(fingerprint=FP))
    # A report stored before the rule (a non-participant's) does not count either.
    with bench.machine.db.tx():
        bench.machine.db.record_report(0, "stranger", OTHER, "{}")
        bench.machine.db.record_report(0, "late", OTHER, "{}")
    assert bench.machine.votes.reported(0) == [FP]
    assert bench.machine.expected_base(1) == FP
    # A participant that left during the round still reports on it.
    bench.machine.leave("c")
    assert bench.machine.report("c", 0, RoundReport(fingerprint=FP))


# ---- the pure rules --------------------------------------------------------------------------


def member(node: str, joined: int = 0, state: MemberState = MemberState.ACTIVE) -> rounds.Member:
    return rounds.Member(node, state, joined)


def test_waited_set_examples() -> None:
    members = [
        member("a"),
        member("b"),
        member("new", joined=9),
        member("gone", 0, MemberState.LEFT),
    ]
    assert rounds.waited_set(members, 10, {"a"}, 2) == {"a", "new"}
    assert rounds.waited_set(members, 10, {"a", "b"}, 2) == {"a", "b", "new"}
    assert rounds.waited_set(members, 1, set(), 2) == {"a", "b"}  # too early to be silent
    assert rounds.waited_set(members[:2], 10, set(), 2) == {"a", "b"}  # all silent: all waited


@given(
    joined=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    recent=st.sets(st.integers(0, 5)),
    round_=st.integers(0, 25),
    n=st.integers(1, 4),
)
def test_waited_set_invariants(joined: list[int], recent: set[int], round_: int, n: int) -> None:
    members = [member(f"m{i}", j) for i, j in enumerate(joined)]
    submitters = {f"m{i}" for i in recent}
    expected = rounds.expected_set(members, round_)
    waited = rounds.waited_set(members, round_, submitters, n)
    assert waited <= expected
    assert bool(waited) == bool(expected)
    # Anyone who submitted lately, or joined too recently to have missed n rounds, is waited for.
    assert {m.node_id for m in members if m.node_id in submitters} & expected <= waited
    assert {m.node_id for m in members if round_ - n < m.joined_round <= round_} <= waited


def test_settled_at_is_the_last_valid_arrival() -> None:
    sub = rounds.Submission
    d = rounds.CloseDecision(
        base_fingerprint=FP,
        gather=(sub("a", 0, "0" * 64, 1, FP), sub("b", 1, "0" * 64, 1, FP)),
        excluded={
            "late": Exclusion.OVER_LIMIT,
            "bad": Exclusion.BAD_DIGEST,
            "silent": Exclusion.MISSED_DEADLINE,
        },
    )
    times = {"a": 103.0, "b": 105.0, "late": 107.0, "bad": 150.0}
    assert rounds.settled_at(d, times, 200.0) == 107.0  # not the bad one, not the deadline
    assert rounds.settled_at(d, {"a": None}, 200.0) == 200.0  # no times kept: the close
    empty = rounds.CloseDecision(FP, (), {"silent": Exclusion.MISSED_DEADLINE})
    assert rounds.settled_at(empty, {}, 200.0) == 200.0
