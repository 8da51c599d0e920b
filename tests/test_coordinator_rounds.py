"""The round rules (pure functions) and the round state machine, with hypothesis.

The pure rules are checked for their invariants over arbitrary submissions; the state machine
(``RoundMachine`` on a real SQLite file, a hand-driven clock, no network) is driven through
random sequences of joins, leaves, submissions and time, checking that rounds close in order,
each exactly once, and that every manifest accounts for every submitter.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coordinator.base.errors import Conflict, RoundError
from coordinator.rules import rounds
from coordinator.rules.machine import RoundMachine
from coordinator.state.db import Database
from coordinator.state.signing import ManifestSigner
from protocol.messages import Exclusion, MemberState, RoundState, SignedManifest, SubmitRequest
from protocol.runconfig import RunConfig, Timing
from protocol.signing import verify_manifest

FPS = ["a" * 32, "b" * 32, "c" * 32]
nodes = st.sampled_from([f"n{i}" for i in range(6)])


@st.composite
def submissions(draw: st.DrawFn) -> list[rounds.Submission]:
    ids = draw(st.lists(nodes, unique=True, max_size=6))
    seqs = draw(st.permutations(range(len(ids))))
    return [
        rounds.Submission(
            node_id=node,
            seq=seq,
            sha256="0" * 64,
            size=1,
            base_fingerprint=draw(st.sampled_from(FPS)),
            rejected=draw(st.sampled_from([None, None, Exclusion.BAD_DIGEST])),
        )
        for node, seq in zip(ids, seqs, strict=True)
    ]


@given(subs=submissions(), g=st.integers(1, 4), reported=st.lists(st.sampled_from(FPS)))
def test_gather_policy_invariants(
    subs: list[rounds.Submission], g: int, reported: list[str]
) -> None:
    members = [rounds.Member(s.node_id, MemberState.ACTIVE, 0) for s in subs]
    members.append(rounds.Member("late", MemberState.ACTIVE, 0))
    d = rounds.decide_close(subs, members, 0, reported, g)
    gathered = {s.node_id for s in d.gather}
    assert len(d.gather) <= g
    assert not gathered & set(d.excluded)
    assert gathered | set(d.excluded) == {s.node_id for s in subs} | {"late"}
    assert d.excluded["late"] == Exclusion.MISSED_DEADLINE
    assert [s.node_id for s in d.gather] == sorted(gathered)
    assert all(s.base_fingerprint == d.base_fingerprint and s.rejected is None for s in d.gather)
    # Gathered ones arrived before every over-limit one.
    over = [s.seq for s in subs if d.excluded.get(s.node_id) == Exclusion.OVER_LIMIT]
    if over:
        assert len(d.gather) == g and max(s.seq for s in d.gather) < min(over)
    # The decision does not depend on the order the submissions are listed in.
    assert rounds.decide_close(list(reversed(subs)), members, 0, reported, g) == d


def test_gather_policy_examples() -> None:
    a, b = FPS[0], FPS[1]
    subs = [
        rounds.Submission("x", 0, "0" * 64, 1, a),
        rounds.Submission("y", 1, "0" * 64, 1, b),
        rounds.Submission("z", 2, "0" * 64, 1, a),
        rounds.Submission("w", 3, "0" * 64, 1, a),
    ]
    members = [
        rounds.Member("gone", MemberState.LEFT, 0, gone_in_round=0),
        rounds.Member("old", MemberState.TIMED_OUT, 0, gone_in_round=-1),
        rounds.Member("next", MemberState.ACTIVE, 1),
    ]
    d = rounds.decide_close(subs, members, 0, [], 2)
    assert [s.node_id for s in d.gather] == ["x", "z"]
    assert d.excluded == {
        "y": Exclusion.WRONG_BASE,
        "w": Exclusion.OVER_LIMIT,
        "gone": Exclusion.LEFT,
    }
    with pytest.raises(ValueError, match="gather_size"):
        rounds.decide_close(subs, members, 0, [], 0)


@given(st.lists(st.sampled_from(FPS)))
def test_majority(values: list[str]) -> None:
    winner = rounds.majority(values)
    if not values:
        assert winner is None
        return
    top = max(values.count(v) for v in values)
    assert winner == min(v for v in values if values.count(v) == top)


def test_base_fingerprint_prefers_reports() -> None:
    subs = [rounds.Submission("x", 0, "0" * 64, 1, FPS[0])]
    assert rounds.base_fingerprint([FPS[1], FPS[2], FPS[1]], subs) == FPS[1]
    assert rounds.base_fingerprint([], subs) == FPS[0]
    assert rounds.base_fingerprint([], []) is None
    assert rounds.majority([FPS[2], FPS[1]]) == FPS[1]  # tie: smallest


@given(
    durations=st.lists(st.floats(0, 1e4, allow_nan=False), max_size=12),
    lo=st.floats(0.1, 100),
    span=st.floats(0, 1000),
    factor=st.floats(1, 5),
    margin=st.floats(0, 100),
)
def test_deadline_is_clamped(
    durations: list[float], lo: float, span: float, factor: float, margin: float
) -> None:
    timing = Timing(
        first_round_s=123.0, min_round_s=lo, max_round_s=lo + span, factor=factor, margin_s=margin
    )
    length = rounds.deadline_length(durations, timing)
    if not durations:
        assert length == 123.0
    else:
        assert lo <= length <= lo + span
        assert rounds.deadline_length(durations[-rounds.DEADLINE_HISTORY :], timing) == length


def test_joined_round_rule() -> None:
    assert rounds.joined_round_for(RoundState.WAITING, 3, True) == 3
    assert rounds.joined_round_for(RoundState.OPEN, 3, False) == 3
    assert rounds.joined_round_for(RoundState.OPEN, 3, True) == 4


class RoundMachineModel(RuleBasedStateMachine):
    """Random traffic against a ``RoundMachine``; rounds must close in order, once each."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="machine"))
        self.now = 1000.0
        timing = Timing(first_round_s=10, min_round_s=5, max_round_s=20, heartbeat_timeout_s=30)
        self.run = RunConfig(rounds=6, gather_size=2, min_nodes=2, timing=timing)
        self.db = Database(self.dir / "db.sqlite")
        self.signer = ManifestSigner.load_or_create(self.dir)
        self.machine = RoundMachine(self.db, self.run, self.signer, clock=lambda: self.now)
        self.closed: list[int] = []
        self.submitted: dict[int, set[str]] = {}
        self.answers: dict[tuple[int, str, str], object] = {}

    def teardown(self) -> None:
        self.db.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _record(self, manifests: list[SignedManifest]) -> None:
        for signed in manifests:
            verify_manifest(signed, self.signer.public_key_hex)
            m = signed.manifest
            assert len(m.gather) <= self.run.gather_size
            gathered = {e.node_id for e in m.gather}
            assert not gathered & set(m.excluded)
            assert self.submitted.get(m.round, set()) <= gathered | set(m.excluded)
            self.closed.append(m.round)

    @rule(node=nodes)
    def join(self, node: str) -> None:
        self.machine.join(node)

    @rule(node=nodes)
    def leave(self, node: str) -> None:
        with contextlib.suppress(Conflict):
            self._record(self.machine.leave(node))

    @rule(node=nodes, fp=st.sampled_from(FPS), ok=st.booleans())
    def submit(self, node: str, fp: str, ok: bool) -> None:
        r = self.machine.round_number()
        req = SubmitRequest(size=1, sha256="0" * 64, base_fingerprint=fp)
        try:
            resp, closed = self.machine.submit(node, r, req, ok)
        except RoundError as exc:
            assert exc.code in {
                "round_closed",
                "not_expected",
                "already_submitted",
                "unknown_round",
            }
            return
        self.submitted.setdefault(r, set()).add(node)
        first = self.answers.setdefault((r, node, fp), resp)
        if first is resp:
            assert resp.accepted == (ok and resp.reason is None)
        else:
            # A repeated identical submit (a retry) gets the first answer, whatever the store
            # says now.
            assert resp == first
        self._record(closed)

    @rule(dt=st.floats(0.1, 40))
    def tick(self, dt: float) -> None:
        self.now += dt
        for node in ("n0", "n1"):  # two members keep heartbeating; others may time out
            with contextlib.suppress(Conflict):
                self.machine.heartbeat(node)
        self._record(self.machine.tick())

    @precondition(lambda self: self.closed)
    @rule()
    def close_again_is_refused(self) -> None:
        with pytest.raises(Conflict):
            self.machine.close(self.closed[-1], self.now)

    @invariant()
    def rounds_close_in_order_once(self) -> None:
        assert self.closed == list(range(len(self.closed)))
        assert len(self.closed) <= self.run.rounds


TestRoundMachine = RoundMachineModel.TestCase
TestRoundMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
