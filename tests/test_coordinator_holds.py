"""No round is spent on nothing: holds, the gathering window and the store-outage pause.

- A round whose deadline passed with no valid submission stays open while a member it expects is
  alive and says it is training or cannot reach the store; it closes (empty, as before) once
  none is. A member that says "training" forever holds only rounds nobody delivered to.
- The first valid submission of a held round gives the others a window (learnt from how far
  apart nodes arrived before), and the round closes early once everyone it waits for is in.
- While the coordinator sees the store down, no deadline closes a round; when the store is back
  the open round's deadline moves later by the outage (one log line each way).
- The heartbeat's body is optional (older nodes send none) and its condition shows in the status.

The pure rules, then ``RoundMachine`` on a real SQLite file with a hand-driven clock (the
pattern of ``test_coordinator_rounds.py``), then the HTTP API on the session's store.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.base.errors import StorageError
from coordinator.rules import rounds
from coordinator.rules.machine import RoundMachine
from coordinator.state.db import Database
from coordinator.state.signing import ManifestSigner
from coordinator.store.storewatch import StoreWatch, WatchedStore, unavailable
from protocol.messages import Exclusion, NodeCondition, RoundState, SubmitRequest
from protocol.runconfig import RunConfig, Timing
from support.api import ApiFactory

FP = "a" * 32
TIMING = Timing(
    first_round_s=100,
    min_round_s=10,
    max_round_s=1000,
    factor=2,
    margin_s=10,
    heartbeat_timeout_s=60,
    silent_rounds=2,
)
TRAINING, WAITING = NodeCondition.TRAINING, NodeCondition.WAITING


# ---- the pure rules --------------------------------------------------------------------------


def test_training_a_lost_store_or_waiting_for_the_previous_round_counts_as_busy() -> None:
    assert rounds.is_busy(NodeCondition.TRAINING)
    assert rounds.is_busy(NodeCondition.STORE_UNREACHABLE)
    assert not rounds.is_busy(NodeCondition.WAITING)
    assert not rounds.is_busy(None)  # a node that does not say (an older one)
    # Waiting, said before this round opened: it waited for the previous one to close, and has
    # been at work since (its next heartbeat says so).
    assert rounds.is_busy(NodeCondition.WAITING, said_at=10.0, opened_at=11.0)
    assert not rounds.is_busy(NodeCondition.WAITING, said_at=12.0, opened_at=11.0)
    assert not rounds.is_busy(None, said_at=10.0, opened_at=11.0)


@given(has_valid=st.booleans(), busy=st.lists(st.sampled_from(["a", "b"])))
def test_a_round_is_held_exactly_when_empty_with_someone_busy(
    has_valid: bool, busy: list[str]
) -> None:
    assert rounds.is_held(has_valid, busy) == (not has_valid and bool(busy))


@given(
    spreads=st.lists(st.floats(0, 500), max_size=8),
    first=st.floats(0, 10_000),
)
def test_the_gathering_window_is_bounded_and_covers_the_learnt_spread(
    spreads: list[float], first: float
) -> None:
    window = rounds.gather_window(spreads, first, TIMING)
    assert 0 < window <= TIMING.max_round_s
    assert window >= min(TIMING.max_round_s, TIMING.margin_s)
    assert window >= min(TIMING.max_round_s, rounds.LATE_SHARE * first)


def test_the_gathering_window_from_history() -> None:
    # Nodes arrived 1-3 s apart: 2 x median(2) + 10 = 14 s; a first arrival 200 s in: 100 s.
    assert rounds.gather_window([1.0, 2.0, 3.0], 20.0, TIMING) == 14.0
    assert rounds.gather_window([1.0, 2.0, 3.0], 200.0, TIMING) == 100.0
    assert rounds.gather_window([], 0.0, TIMING) == TIMING.margin_s
    assert rounds.gather_window([], 1e6, TIMING) == TIMING.max_round_s


def test_an_outage_moves_a_deadline_by_what_it_took_from_the_round() -> None:
    assert rounds.paused_by(outage_from=100, started_at=50, now=160) == 60
    assert rounds.paused_by(outage_from=100, started_at=130, now=160) == 30  # opened during it
    assert rounds.paused_by(outage_from=100, started_at=50, now=90) == 0


# ---- the machine -----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Bench:
    def __init__(self, tmp_path: Path, nodes: int = 2, **run: Any) -> None:
        self.tmp_path = tmp_path
        self.db = Database(tmp_path / "db.sqlite")
        self.clock = Clock()
        self.run = RunConfig(rounds=6, min_nodes=nodes, timing=TIMING, **run)
        self.machine = self.restart()
        self.nodes = [f"n{i}" for i in range(nodes)]
        for node in self.nodes:
            self.machine.join(node)

    def restart(self) -> RoundMachine:
        signer = ManifestSigner.load_or_create(self.tmp_path)
        self.machine = RoundMachine(self.db, self.run, signer, clock=self.clock)
        return self.machine

    def beat(self, condition: NodeCondition | None, *nodes: str) -> None:
        for node in nodes or tuple(self.nodes):
            self.machine.heartbeat(node, condition)

    def submit(self, node: str, round_: int) -> list[int]:
        req = SubmitRequest(size=1, sha256="0" * 64, base_fingerprint=FP)
        resp, closed = self.machine.submit(node, round_, req, True)
        assert resp.accepted
        return [m.manifest.round for m in closed]

    def deadline(self, round_: int) -> float:
        row = self.db.get_round(round_)
        assert row is not None and row.deadline is not None
        return row.deadline

    def state(self, round_: int) -> RoundState | None:
        return self.db.round_state(round_)

    def gather(self, round_: int) -> list[str]:
        signed = self.machine.manifest(round_)
        assert signed is not None
        return [e.node_id for e in signed.manifest.gather]


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    b = Bench(tmp_path)
    yield b
    b.db.close()


def test_an_empty_round_is_held_while_members_train_then_gathers_them_all(
    bench: Bench, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.coordinator")
    bench.clock.now = bench.deadline(0) + 500  # slowed nodes: far past the deadline
    bench.beat(TRAINING)
    assert bench.machine.tick() == []
    assert bench.state(0) == RoundState.OPEN
    assert sum("event=round_held round=0" in r.message for r in caplog.records) == 1
    assert bench.submit("n0", 0) == []  # not closed with one node: the others get a window
    assert bench.deadline(0) > bench.clock.now
    assert "event=round_gathering round=0 first=n0" in caplog.text
    bench.clock.now += 5
    assert bench.submit("n1", 0) == [0]  # everyone waited for is in: it closes at once
    assert bench.gather(0) == ["n0", "n1"]


def test_a_held_round_closes_with_whoever_came_when_the_window_ends(bench: Bench) -> None:
    bench.clock.now = bench.deadline(0) + 1
    bench.beat(TRAINING)
    assert bench.machine.tick() == []
    assert bench.submit("n0", 0) == []
    bench.clock.now = bench.deadline(0)
    assert [m.manifest.round for m in bench.machine.tick()] == [0]
    assert bench.gather(0) == ["n0"]


def test_an_empty_round_closes_at_its_deadline_once_nobody_is_at_work(bench: Bench) -> None:
    bench.clock.now = bench.deadline(0) + 1
    bench.beat(TRAINING)
    assert bench.machine.tick() == []
    bench.beat(WAITING, "n0")
    assert bench.machine.tick() == []  # n1 still trains
    bench.beat(None, "n1")  # says nothing (an older node): not counted as at work
    closed = bench.machine.tick()
    assert [m.manifest.round for m in closed] == [0]
    assert closed[0].manifest.gather == []


def test_a_member_that_died_stops_holding_a_round(bench: Bench) -> None:
    bench.clock.now = bench.deadline(0) + 1
    bench.beat(TRAINING)
    assert bench.machine.tick() == []
    bench.clock.now += TIMING.heartbeat_timeout_s + 1  # both fall silent: timed out
    closed = bench.machine.tick()
    assert [m.manifest.round for m in closed] == [0]
    assert closed[0].manifest.excluded == {
        "n0": Exclusion.TIMED_OUT.value,
        "n1": Exclusion.TIMED_OUT.value,
    }


def test_a_member_training_forever_does_not_hold_a_round_others_delivered_to(
    bench: Bench,
) -> None:
    for r in range(3):
        bench.clock.now += 5
        bench.beat(TRAINING, "n1")  # says it trains, never submits
        assert bench.submit("n0", r) == [] or r >= TIMING.silent_rounds
        if bench.state(r) == RoundState.OPEN:
            bench.clock.now = bench.deadline(r)
            bench.beat(TRAINING, "n1")
            bench.beat(WAITING, "n0")
            assert [m.manifest.round for m in bench.machine.tick()] == [r]  # today's rule
        assert bench.gather(r) == ["n0"]


def test_members_count_as_at_work_until_their_first_heartbeat_after_a_restart(
    bench: Bench,
) -> None:
    bench.clock.now = bench.deadline(0) + 1
    bench.beat(WAITING)
    bench.restart()  # the coordinator was down past the deadline
    assert bench.machine.tick() == []  # nobody has said anything yet: held
    bench.beat(WAITING)
    assert [m.manifest.round for m in bench.machine.tick()] == [0]


def test_no_deadline_closes_a_round_while_the_store_is_down(bench: Bench) -> None:
    bench.clock.now += 5
    assert bench.submit("n0", 0) == []  # a round with a payload: no hold
    before = bench.deadline(0)
    assert bench.machine.store_down() == 0
    bench.clock.now = before + 30
    bench.beat(WAITING)
    assert bench.machine.tick() == []
    assert bench.machine.store_back() == (0, pytest.approx(before + 30 - 1005))
    assert bench.deadline(0) == pytest.approx(before + (before + 30 - 1005))
    assert bench.machine.tick() == []  # the outage's time is given back
    bench.clock.now = bench.deadline(0)
    assert [m.manifest.round for m in bench.machine.tick()] == [0]


# ---- the store watch -------------------------------------------------------------------------


class FlakyStore:
    """Answers HEADs (404) unless ``down``; then fails as an unreachable endpoint does."""

    def __init__(self) -> None:
        self.down = False

    def presign_put(self, key: str, size: int, sha256_hex: str) -> tuple[str, dict[str, str]]:
        return key, {}

    def presign_get(self, key: str) -> str:
        return key

    async def head(self, key: str) -> None:
        if self.down:
            raise StorageError(f"head {key}: ClientConnectorError")
        return None

    async def sizes(self, prefix: str) -> dict[str, int]:
        if self.down:
            raise StorageError(f"list {prefix}: ClientConnectorError")
        return {}

    async def put_bytes(self, key: str, data: bytes) -> None:
        if key == "forbidden":
            raise StorageError("put forbidden: AccessDenied", code="AccessDenied")

    async def get_bytes(self, key: str, max_size: int) -> bytes | None:
        return None

    async def read_chunks(self, key: str, max_size: int, consume: Any, **kw: Any) -> bool:
        return False

    async def delete_keys(self, keys: list[str]) -> int:
        return len(keys)

    async def delete_prefix(self, prefix: str) -> int:
        return 0


def test_only_no_answer_counts_as_the_store_being_down() -> None:
    assert unavailable(StorageError("head k: ClientConnectorError"))
    assert unavailable(StorageError("head k: HTTP 503", code="503"))
    assert unavailable(TimeoutError())
    assert not unavailable(StorageError("put k: AccessDenied", code="AccessDenied"))
    assert not unavailable(ValueError("a bad checkpoint"))


@pytest.mark.asyncio
async def test_the_watch_pauses_deadlines_for_the_outage_and_logs_it_twice(
    bench: Bench, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sparseloco.coordinator")
    flaky = FlakyStore()
    watch = StoreWatch(bench.machine)
    store = WatchedStore(flaky, watch)
    bench.clock.now += 5
    bench.submit("n0", 0)
    before = bench.deadline(0)
    with pytest.raises(StorageError):
        await store.put_bytes("forbidden", b"")  # an answer (a refusal): still up
    assert watch.up
    flaky.down = True
    for _ in range(3):
        with pytest.raises(StorageError):
            await store.head("k")
    assert not watch.up
    bench.clock.now = before + 60
    bench.beat(WAITING)
    assert bench.machine.tick() == []
    flaky.down = False
    assert await store.head("k") is None
    assert watch.up and bench.deadline(0) > before + 60
    lines = [r.message for r in caplog.records if "event=deadline_" in r.message]
    assert len(lines) == 2, lines
    assert lines[0] == "event=deadline_paused round=0 why=store_unreachable"
    assert lines[1].startswith("event=deadline_resumed round=0 paused_s=")


# ---- the API ---------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_heartbeat_body_is_optional_and_its_condition_shows(make_api: ApiFactory) -> None:
    api = await make_api(RunConfig(rounds=3, min_nodes=1))
    await api.call("POST", "/v1/join", "n0", {})
    status, view = await api.call("POST", "/v1/heartbeat", "n0")  # no body: an older node
    assert status == 200 and view["round"] == 0
    status, _ = await api.call("POST", "/v1/heartbeat", "n0", {"condition": "store_unreachable"})
    assert status == 200
    status, body = await api.call("GET", "/v1/status", None)
    assert status == 200
    assert [m["condition"] for m in body["members"]] == ["store_unreachable"]
    status, err = await api.call("POST", "/v1/heartbeat", "n0", {"condition": "asleep"})
    assert status == 422 and err["field"] == "condition"
