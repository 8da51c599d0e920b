"""A round's time budget and the work each submission carries, on the coordinator's side.

- The pure rule (``coordinator.rules.budget``): a member's whole-round time from its arrivals
  and steps, the median (or fastest) of the members', the slack, a fixed or no budget.
- The machine on a real SQLite file with a hand-driven clock: no budget before any history,
  then the median member's pace in every round view (``budget_s``, ``budget_in_s``); a slow
  member cut short does not lengthen it; the steps and tokens a node submits reach the signed
  manifest; a member that only observes is not waited for.
- The HTTP API: steps above H are refused with 422 naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.rules import budget
from coordinator.rules.machine import RoundMachine
from coordinator.state.db import Database
from coordinator.state.signing import ManifestSigner
from protocol.messages import NodeCondition, RoundState, SubmitRequest
from protocol.runconfig import RunConfig, Timing
from protocol.signing import verify_manifest
from support.api import ApiFactory

FP = "a" * 32
H = 30


def timing(**over: Any) -> Timing:
    values: dict[str, Any] = dict(first_round_s=100, min_round_s=10, max_round_s=1000)
    return Timing(**{**values, **over})


# ---- the pure rule ---------------------------------------------------------------------------


def test_a_cut_member_counts_as_needing_the_whole_round() -> None:
    assert budget.whole_round_s(10.0, H, H) == 10.0
    assert budget.whole_round_s(10.0, 10, H) == 30.0  # a third of the steps in 10 s
    assert budget.whole_round_s(10.0, None, H) == 10.0  # unsaid: H
    assert budget.whole_round_s(10.0, 10 * H, H) == 10.0  # a claim above H is H


def test_the_budget_is_the_median_members_pace_with_slack() -> None:
    # Four members at about 10 s a round, one cut to a third of the steps: it needs 30 s.
    history = [[("a", 10.0, H), ("b", 10.2, H), ("c", 9.8, H), ("d", 10.0, 10), ("e", 10.0, H)]]
    got = budget.budget_s(history, timing(), H)
    assert got == pytest.approx(10.0 * (1 + budget.SLACK) + budget.MARGIN_S)
    fastest = budget.budget_s(history, timing(budget="fastest"), H)
    assert fastest == pytest.approx(9.8 * (1 + budget.SLACK) + budget.MARGIN_S)


def test_mixed_speeds_take_the_median_of_the_members() -> None:
    # Speeds 1, 1/2, 1/3, 1/5 at 10 s a round for the fastest: 10, 20, 30, 50 -> median 25.
    history = [[("a", 10.0, H), ("b", 20.0, H), ("c", 30.0, H), ("d", 50.0, H)]]
    assert budget.member_times(history, H) == {"a": 10.0, "b": 20.0, "c": 30.0, "d": 50.0}
    want = 25.0 * (1 + budget.SLACK) + budget.MARGIN_S
    assert budget.budget_s(history, timing(), H) == pytest.approx(want)


def test_a_hostile_minority_cannot_set_the_median_pace() -> None:
    # 3 of 8 members collude: they submit 0.1 s after the opening and claim H steps, to cut
    # everyone else's round to nothing. The median stays within the honest members' times;
    # "fastest" takes theirs (which is why it is not the default: benchmark 18).
    honest = [(f"h{i}", 10.0 + i, H) for i in range(5)]
    hostile = [(f"x{i}", 0.1, H) for i in range(3)]
    history = [honest + hostile] * budget.HISTORY
    got = budget.budget_s(history, timing(), H)
    assert got is not None and got >= 10.0 * (1 + budget.SLACK)  # at least the fastest honest
    fastest = budget.budget_s(history, timing(budget="fastest"), H)
    assert fastest == pytest.approx(0.1 * (1 + budget.SLACK) + budget.MARGIN_S)


def test_only_the_members_active_now_and_the_recent_rounds_count() -> None:
    old = [[("gone", 500.0, H)]] * 10
    recent = [[("a", 10.0, H), ("b", 12.0, H)]] * budget.HISTORY
    times = budget.member_times(old + recent, H)
    assert "gone" not in times  # older than HISTORY rounds
    assert budget.member_times(recent, H, members=["a"]) == {"a": 10.0}


def test_no_history_fixed_and_off() -> None:
    assert budget.budget_s([], timing(), H) is None
    assert budget.budget_s([[("a", 5.0, H)]], timing(budget="off"), H) is None
    assert budget.budget_s([], timing(budget=42.0), H) == 42.0
    assert budget.budget_s([], timing(budget=5000.0, max_round_s=1000), H) == 1000
    capped = budget.budget_s([[("a", 5000.0, H)]], timing(max_round_s=1000), H)
    assert capped == 1000


def test_a_budget_that_is_neither_a_name_nor_seconds_is_refused() -> None:
    for bad in ("slowest", 0, -3, True):
        with pytest.raises(ValueError, match="budget must be"):
            Timing(budget=bad)


# ---- the machine -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Bench:
    def __init__(self, tmp_path: Path, nodes: int = 4, **run: Any) -> None:
        self.db = Database(tmp_path / "db.sqlite")
        self.clock = Clock()
        self.run = RunConfig(
            rounds=8, min_nodes=nodes, inner_steps=H, timing=timing(), checkpoint_every=0, **run
        )
        signer = ManifestSigner.load_or_create(tmp_path)
        self.machine = RoundMachine(self.db, self.run, signer, clock=self.clock)
        self.key = signer.public_key_hex
        self.nodes = [f"n{i}" for i in range(nodes)]
        for node in self.nodes:
            self.machine.join(node)

    def submit(self, node: str, round_: int, steps: int | None = H) -> list[int]:
        req = SubmitRequest(
            size=1, sha256="0" * 64, base_fingerprint=FP, steps=steps, tokens=(steps or 0) * 8
        )
        resp, closed = self.machine.submit(node, round_, req, True)
        assert resp.accepted
        return [m.manifest.round for m in closed]

    def play(self, round_: int, arrivals: dict[str, tuple[float, int]]) -> None:
        """Every node submits ``(seconds after the opening, steps)``; the round closes."""
        row = self.db.get_round(round_)
        assert row is not None and row.started_at is not None
        opened = row.started_at
        for node, (after, steps) in sorted(arrivals.items(), key=lambda kv: kv[1][0]):
            self.clock.now = opened + after
            self.submit(node, round_, steps)
        assert self.db.round_state(round_) == RoundState.CLOSED


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    b = Bench(tmp_path)
    yield b
    b.db.close()


def test_the_first_round_has_no_budget_then_the_median_pace(bench: Bench) -> None:
    view = bench.machine.round_view("n0")
    assert view.round == 0 and view.budget_s is None and view.budget_in_s is None
    # At equal speeds: 10 s each.
    bench.play(0, {n: (10.0, H) for n in bench.nodes})
    view = bench.machine.round_view("n0")
    paced = 10.0 * (1 + budget.SLACK) + budget.MARGIN_S
    assert view.round == 1 and view.budget_s == pytest.approx(paced)
    bench.clock.now += 4.0
    assert bench.machine.round_view("n0").budget_in_s == pytest.approx(paced - 4.0)
    # n3 slows to a third and is cut short to a third of the steps, arriving within the
    # budget: its pace is 3x slower, the median is still the others', the budget stays.
    for r in (1, 2, 3):
        bench.play(r, {"n0": (10.0, H), "n1": (10.1, H), "n2": (9.9, H), "n3": (11.0, 10)})
        assert bench.machine.round_view("n0").budget_s == pytest.approx(paced, rel=0.02)


def test_the_work_submitted_is_in_the_signed_manifest(bench: Bench) -> None:
    bench.play(0, {"n0": (1.0, H), "n1": (1.0, 12), "n2": (1.0, 1), "n3": (1.0, H)})
    signed = bench.machine.manifest(0)
    assert signed is not None
    manifest = verify_manifest(signed, bench.key, run_id=bench.run.run_id, round_=0)
    assert {e.node_id: (e.steps, e.tokens) for e in manifest.gather} == {
        "n0": (H, 8 * H), "n1": (12, 96), "n2": (1, 8), "n3": (H, 8 * H),
    }  # fmt: skip


def test_a_member_that_only_observes_is_not_waited_for(bench: Bench) -> None:
    bench.machine.heartbeat("n3", NodeCondition.OBSERVING)
    for node in ("n0", "n1"):
        assert bench.submit(node, 0) == []
    assert bench.submit("n2", 0) == [0]  # closed with three: n3 only observes
    # Once it says it trains again it is waited for again.
    bench.machine.heartbeat("n3", NodeCondition.TRAINING)
    for node in ("n0", "n1", "n2"):
        assert bench.submit(node, 1) == []
    assert bench.db.round_state(1) == RoundState.OPEN
    assert bench.submit("n3", 1) == [1]


def test_a_round_of_observers_only_does_not_close_at_once(bench: Bench) -> None:
    for node in bench.nodes:
        bench.machine.heartbeat(node, NodeCondition.OBSERVING)
    assert bench.machine.tick() == []
    assert bench.db.round_state(0) == RoundState.OPEN


# ---- the API ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_more_steps_than_h_are_refused(make_api: ApiFactory) -> None:
    api = await make_api(RunConfig(inner_steps=5, min_nodes=1))
    status, _ = await api.call("POST", "/v1/join", "n0", {})
    assert status == 200
    body = {"size": 10, "sha256": "0" * 64, "base_fingerprint": FP, "steps": 6, "tokens": 10}
    status, answer = await api.call("POST", "/v1/rounds/0/submit", "n0", body)
    assert status == 422
    assert answer["field"] == "steps" and "inner_steps=5" in answer["message"]
    body["steps"] = 0  # at least one step: the body's own bound
    status, answer = await api.call("POST", "/v1/rounds/0/submit", "n0", body)
    assert status in (400, 422) and answer["field"] == "steps"
