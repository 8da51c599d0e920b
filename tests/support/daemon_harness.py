"""Running real ``NodeDaemon``s against the in-memory fakes, for the daemon's unit tests.

``run_config`` is a small, fast run whose deadlines and heartbeat window lie far beyond anything
a test does unless it advances the clock; the ``harness`` fixture (registered for every test in
``tests/conftest.py``) makes ``Harness``es and closes them after the test.

``Harness`` owns one ``FakeCoordinator`` (the real round machine), one ``FakeStore`` and one
``FakeClock``, and builds daemons wired to them, each with its own state directory under the
test's tmp dir. ``reference_fingerprints`` is what one node alone must end up with, computed
with the worker directly (train, compress, read the own payload, apply), so a test can check a
daemon's θ bit for bit without trusting the daemon.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from node.compute.stateread import load_state
from node.compute.worker import TrainResult, Worker
from node.daemon.faults import Faults
from node.daemon.loop import NodeDaemon
from node.daemon.settings import NodeSettings
from protocol.codec import Payload
from protocol.messages import SignedManifest
from protocol.reports import Mass, RoundReport
from protocol.runconfig import RunConfig, Timing
from support.fake_coordinator import FakeCoordinator
from support.fake_store import FakeClock, FakeStore

#: Real seconds any wait of a test may take before it counts as a hang.
HANG_S = 120.0

#: Deadlines and heartbeat windows far beyond anything a test does unless it advances the clock;
#: no time budget (the manual clock stands still while a node trains: a budget learnt from it
#: would be nothing), so every node trains H steps unless a test gives the run a budget.
PATIENT = Timing(
    first_round_s=1000,
    min_round_s=1000,
    max_round_s=1000,
    heartbeat_timeout_s=10_000,
    budget="off",
)


def run_config(**changes: object) -> RunConfig:
    """The tiny model, 3 rounds of H=2, no checkpoints, patient timing; ``changes`` on top."""
    values: dict[str, object] = {
        "name": "unit",
        "model": "tiny",
        "rounds": 3,
        "inner_steps": 2,
        "batch_size": 2,
        "checkpoint_every": 0,
        "timing": PATIENT,
    }
    values.update(changes)
    return RunConfig.model_validate(values)


class Crash(BaseException):
    """Raised at a crash point instead of exiting: the state dir is left as kill -9 leaves it."""


def crash() -> None:
    raise Crash()


def crash_at(round_: int, point: str) -> Faults:
    return Faults(crash={round_: point}, die=crash)


class Harness:
    def __init__(self, root: Path, run: RunConfig) -> None:
        self.root = root
        self.run = run
        self.clock = FakeClock()
        self.store = FakeStore()
        self.coord = FakeCoordinator(run, root / "coordinator", self.store, self.clock)
        self.daemons: dict[str, NodeDaemon] = {}

    def state_dir(self, node_id: str) -> Path:
        return self.root / "nodes" / node_id

    def daemon(self, node_id: str, faults: Faults | None = None, **settings: Any) -> NodeDaemon:
        """A daemon for ``node_id``; ``settings`` override its ``NodeSettings``.

        A restarted node's predecessor here (one that raised ``Crash``) is an object in this
        process, whose state writes behind (``node.compute.state``) still run: they finish
        before the new daemon starts, so two never write one state dir at once (a killed
        process's threads end with it; the case of a write that never happened is
        ``test_worker_state``'s).
        """
        previous = self.daemons.get(node_id)
        if previous is not None and previous.ctx.shard is not None:
            previous.ctx.shard.worker.writes.wait()
        values: dict[str, Any] = {
            "coordinator": "http://coordinator.invalid",
            "allow_insecure_http": True,  # a placeholder: the fakes never dial it
            "token": "unit-test-token-" + node_id,
            "state_dir": self.state_dir(node_id),
            "threads": 1,
            "device": "cpu",  # the same bytes on a machine with a GPU
            "eval_batches": 1,
            "eval_batch_size": 2,
            **settings,
        }
        daemon = NodeDaemon(
            NodeSettings(**values),
            self.coord.api(node_id),
            self.store.transfers(node_id),
            clock=self.clock,
            faults=faults if faults is not None else Faults(),
        )
        self.daemons[node_id] = daemon
        return daemon

    def start(self, daemon: NodeDaemon) -> asyncio.Task[int]:
        return asyncio.create_task(daemon.run(handle_signals=False), name=daemon.settings.token)

    def reports(self, round_: int) -> dict[str, RoundReport]:
        """Every node's report of ``round_`` as the coordinator recorded it."""
        return {
            node: RoundReport.model_validate(body)
            for node, body in self.coord.db.reports(round_).items()
        }

    def manifest(self, round_: int) -> SignedManifest:
        signed = self.coord.machine.manifest(round_)
        assert signed is not None, f"round {round_} is not closed"
        return signed

    def saved_fingerprint(self, node_id: str, shapes: dict[str, tuple[int, ...]]) -> str:
        state = load_state(self.state_dir(node_id), shapes)
        assert state is not None
        return state.fingerprint

    async def advance_until(self, done: Callable[[], bool], step_s: float) -> None:
        """Let fake time pass in steps (so heartbeats keep members alive) until ``done()``."""
        async with asyncio.timeout(HANG_S):
            while not done():
                self.coord.advance(step_s)
                await asyncio.sleep(0.01)

    def close(self) -> None:
        self.coord.close()


async def until(done: Callable[[], bool], what: str) -> None:
    """Wait (on the real clock, polling) until ``done()``; fail after ``HANG_S``."""
    try:
        async with asyncio.timeout(HANG_S):
            while not done():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


def worker(run: RunConfig, node_id: str = "node-0", slot: int = 0) -> Worker:
    return Worker(
        run, run_id=run.run_id, node_id=node_id, slot=slot, eval_batches=1, eval_batch_size=2
    )


def reference_fingerprints(run: RunConfig, node_id: str = "node-0") -> list[str]:
    """θ's fingerprint after each round for one node alone, straight through the worker: with
    overlap, round r+1 trains from θ_r before round r's aggregate is applied.

    Computed on a fresh thread, as the daemon computes on its own compute thread: torch's
    intra-op thread pool is set up per calling thread, and a different number of threads sums
    in a different order (the bits of training depend on it, on every machine alike)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_reference, run, node_id).result()


def _reference(run: RunConfig, node_id: str) -> list[str]:
    w = worker(run, node_id)
    out = []
    if not run.overlaps:
        for _ in range(run.rounds):
            result = w.train_and_compress()
            w.apply({node_id: w.read(result.payload)})
            out.append(w.fingerprint())
        return out
    if run.overlap == "merge":
        return _merged_reference(w, run, node_id)
    pending: TrainResult | None = w.train_and_compress()
    for r in range(run.rounds):
        assert pending is not None
        following = None
        if r + 1 < run.rounds:
            offset = w.eager_offset(r) if run.overlap == "eager" else None
            following = w.train_and_compress(r + 1, offset)
        w.apply({node_id: w.read(pending.payload)})
        out.append(w.fingerprint())
        pending = following
    return out


def _merged_reference(w: Worker, run: RunConfig, node_id: str) -> list[str]:
    """Overlap "merge": round r's aggregate is merged after τ inner steps of round r+1."""
    tau = run.merge_step
    assert tau is not None
    result = w.train_and_compress()
    out = []
    for r in range(run.rounds):
        payloads = {node_id: w.read(result.payload)}
        if r + 1 < run.rounds:
            result = w.train_and_compress(
                r + 1, merge=(tau, run.merge_rows, functools.partial(_merge, w, payloads))
            )
        else:
            w.apply(payloads)
        out.append(w.fingerprint())
    return out


def _merge(w: Worker, payloads: dict[str, Payload]) -> None:
    w.merge(payloads)


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Callable[[RunConfig], Harness]]:
    """Makes ``Harness``es in the test's tmp dir; closes them when the test ends."""
    made: list[Harness] = []

    def make(run: RunConfig) -> Harness:
        h = Harness(tmp_path, run)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def assert_mass_balanced(mass: Mass | None) -> None:
    """The error-feedback account of a report closes: computed = sent + held."""
    assert isinstance(mass, Mass)
    assert abs(mass.computed - mass.sent - mass.held) <= 1e-5 * max(1.0, mass.scale)
