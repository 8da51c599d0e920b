"""Run a chaos scenario against a local cluster of real processes and check every closed round.

``ScenarioRunner`` starts the coordinator and the nodes (``support.cluster``), then polls the
coordinator's status: each step fires once its round is open or closed there, never after a
sleep. On every poll it also reaps processes: a node that died from its own armed crash fault
(exit 137) is restarted without faults, as a supervisor would; any other unexpected exit is a
failure (and the node is restarted so the run can be judged to the end). Each newly closed round
gets its manifest checked in the bucket at once, before retention may prune it; the checks over
reports (agreement, mass) run on every poll and once more at the end; checkpoints, retention and
the loss against the fault-free baseline at the end.

The result is a JSON-ready dict (built in ``ScenarioRunner._finish``, with the fault list and
recovery from ``results``), written to the test's tmp dir and, when ``CHAOS_RESULTS`` is set, to
that file (or ``{name}.json`` in that directory).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node.cluster.seaweed import EmbeddedStore
from protocol.keys import manifest_key
from protocol.messages import MemberState, RoundState
from protocol.status import StatusView
from support.cluster import Cluster

from .invariants import (
    Bucket,
    Failure,
    check_agreement,
    check_checkpoint,
    check_close_logs,
    check_manifest,
    check_mass,
    check_retention,
    check_round_numbers,
    closed,
    reference_fingerprint,
)
from .results import (
    check_recovery,
    fault_list,
    recovery,
    rejoins,
    trajectory,
)
from .scenario import Scenario, Step

POLL_S = 0.1
#: A node may die unexpectedly this many times before the scenario gives up on it.
MAX_UNEXPECTED_RESTARTS = 3
CRASH_EXIT = 137


@dataclass
class _Pending:
    """A fault in progress (store down, node stopped) and what ends it."""

    step: Step
    started: float
    log_sizes: dict[str, int] = field(default_factory=dict)


class ScenarioRunner:
    def __init__(self, scenario: Scenario, root: Path, store: EmbeddedStore) -> None:
        self.sc = scenario
        self.root = root
        self.store = store
        prefix = f"chaos-{root.parent.name}-{root.name}"
        self.cluster = Cluster(root, store, scenario.run, scenario.nodes, prefix=prefix)
        self.bucket = Bucket(store.client(), store.bucket)
        self.failures: set[Failure] = set()
        self.events: list[dict[str, Any]] = []
        self.armed: dict[str, str | None] = {}
        self.unexpected: dict[str, int] = {}
        self.checked: set[int] = set()
        self.status: StatusView | None = None
        self.pending: _Pending | None = None
        self.store_down = False
        self._killed: set[str] = set()
        self._coordinator_killed = False
        #: Set from another thread to end the run early (its processes stopped, no result).
        self.abandoned = threading.Event()
        self.t0 = time.monotonic()

    # ---- processes -------------------------------------------------------------------------

    def _event(self, action: str, target: str | None = None, **extra: Any) -> None:
        cur = self.status.round if self.status else None
        self.events.append(
            {
                "t_s": round(time.monotonic() - self.t0, 2),
                "round_now": cur,
                "action": action,
                "target": target,
                **extra,
            }
        )

    def _start(self, name: str, faults: str | None) -> None:
        self.armed[name] = faults
        self.cluster.start_node(name, faults)

    def _finished(self) -> bool:
        """Whether the run is over, asked again: the last status polled may be a few tiny
        rounds old, and a node that exits 0 has just seen the run's last round."""
        if self.status is not None and self.status.state == RoundState.FINISHED:
            return True
        with contextlib.suppress(urllib.error.URLError, OSError):
            self.status = self.cluster.status()
        return self.status is not None and self.status.state == RoundState.FINISHED

    def _reap(self) -> None:
        for name, proc in list(self.cluster.nodes.items()):
            code = proc.poll()
            if code is None or (code == 0 and self._finished()):
                continue
            if code == -signal.SIGKILL and name in self._killed:
                continue  # our own kill -9: a restart_node step brings it back
            if code == CRASH_EXIT and self.armed.get(name):
                self._event("crashed", name, faults=self.armed[name])
                self._start(name, None)
                continue
            self.unexpected[name] = self.unexpected.get(name, 0) + 1
            self.failures.add(
                Failure(
                    "process",
                    self.status.round if self.status else -1,
                    f"{name} exited with {code} unexpectedly:\n{proc.tail(25)}",
                )
            )
            if self.unexpected[name] > MAX_UNEXPECTED_RESTARTS:
                raise AssertionError(f"{name} keeps dying; logs in {self.root / 'logs'}")
            self._event("unexpected_exit", name, code=code)
            self._start(name, None)
        coord = self.cluster.coordinator
        if coord is not None and coord.poll() is not None and not self._coordinator_killed:
            raise AssertionError(f"the coordinator exited with {coord.poll()}:\n{coord.tail(40)}")

    # ---- steps -----------------------------------------------------------------------------

    def _due(self, step: Step) -> bool:
        s = self.status
        if s is None:
            return False
        done = {r.round for r in closed(s)}
        if step.when == "closed":
            return step.round in done or s.state == RoundState.FINISHED
        return s.round > step.round or (
            s.round == step.round and s.state in (RoundState.OPEN, RoundState.FINISHED)
        )

    def _fire(self, step: Step) -> None:
        name = step.target
        self._event(step.action, name, step=step.describe())
        if step.action == "kill_node":
            assert name is not None
            self._killed.add(name)
            proc = self.cluster.nodes[name]
            proc.kill()
        elif step.action in ("restart_node", "start_node"):
            assert name is not None
            self._killed.discard(name)
            self._start(name, step.faults)
        elif step.action == "kill_coordinator":
            self._coordinator_killed = True
            self.cluster.kill_coordinator()  # the last status seen still keys the next steps
        elif step.action == "restart_coordinator":
            self.cluster.start_coordinator()
            self._coordinator_killed = False
        elif step.action == "coordinator_outage":
            self._coordinator_killed = True
            self.cluster.kill_coordinator()
            self.pending = _Pending(step, time.monotonic())
        elif step.action == "store_outage":
            sizes = {n: _size(p.log_path) for n, p in self.cluster.nodes.items()}
            self.store.stop()
            self.store_down = True
            self.pending = _Pending(step, time.monotonic(), sizes)
        elif step.action == "pause_node":
            assert name is not None
            self.cluster.nodes[name].send_signal(signal.SIGSTOP)
            self.pending = _Pending(step, time.monotonic())

    def _settle(self) -> None:
        """End the fault in progress once its condition holds (or its time bound passed)."""
        p = self.pending
        if p is None:
            return
        held = time.monotonic() - p.started
        if held < p.step.min_s:
            return
        if p.step.action == "store_outage":
            seen = self._retry_logged(p.log_sizes)
            if not seen and held < p.step.max_s:
                return
            self.store.start()
            self.store_down = False
            self._event("store_back", held_s=round(held, 1), retry_seen=seen)
        elif p.step.action == "coordinator_outage":
            self.cluster.start_coordinator()
            self._coordinator_killed = False
            self._event("coordinator_back", held_s=round(held, 1))
        else:
            name = p.step.target
            assert name is not None
            gone = self.status is not None and any(
                m.node_id == name and m.state == MemberState.TIMED_OUT for m in self.status.members
            )
            if not gone and held < p.step.max_s:
                return
            self.cluster.nodes[name].send_signal(signal.SIGCONT)
            self._event("resumed", name, held_s=round(held, 1), timed_out=gone)
            if not gone:
                self.failures.add(
                    Failure("timeout", -1, f"{name} stopped {held:.0f} s, never timed out")
                )
        self.pending = None

    def _retry_logged(self, sizes: dict[str, int]) -> bool:
        for name, proc in self.cluster.nodes.items():
            with open(proc.log_path, "rb") as f:
                f.seek(sizes.get(name, 0))
                if b"event=unreachable service=store" in f.read():
                    return True
        return False

    # ---- observing -------------------------------------------------------------------------

    def _poll_status(self) -> None:
        if self.cluster.coordinator is None or self._coordinator_killed:
            return
        # Restarting, or busy closing a round: the next poll sees it.
        with contextlib.suppress(urllib.error.URLError, OSError):
            self.status = self.cluster.status()

    def _check_new_rounds(self, final: bool = False) -> None:
        s = self.status
        if s is None or self.store_down:
            return
        for summary in closed(s):
            if summary.round in self.checked:
                continue
            raw = self.bucket.get(manifest_key(self.cluster.prefix, s.run_id, summary.round))
            if raw is None and not final:
                continue  # the coordinator publishes just after closing: look again next poll
            self.failures.update(
                check_manifest(summary, raw, self.public_key, self.bucket, run_id=s.run_id)
            )
            self.checked.add(summary.round)

    @property
    def public_key(self) -> str:
        return self.cluster.public_key()

    def _check_reports(self, s: StatusView) -> list[dict[str, Any]]:
        agreement, records = check_agreement(s)
        self.failures.update(agreement)
        self.failures.update(check_mass(s))
        self.failures.update(check_round_numbers(s))
        return records

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        sc = self.sc
        deadline = self.t0 + sc.timeout_s
        self.cluster.start_coordinator()
        for name in sc.names:
            if name not in sc.late:
                self._start(name, sc.faults.get(name))
        steps = list(sc.steps)
        try:
            while True:
                if self.abandoned.is_set():
                    raise RuntimeError(f"scenario {sc.name} abandoned: the run beside it failed")
                if time.monotonic() > deadline:
                    left = [s.describe() for s in steps]
                    raise AssertionError(
                        f"scenario {sc.name} not done in {sc.timeout_s:.0f} s (steps left:"
                        f" {left}); logs in {self.root / 'logs'}"
                    )
                self._poll_status()
                self._reap()
                self._settle()
                while steps and self.pending is None and self._due(steps[0]):
                    self._fire(steps.pop(0))
                self._check_new_rounds()
                if self._done(steps):
                    break
                time.sleep(POLL_S)
            final = self.cluster.status()
            self.status = final
            self._reap()
            self._check_new_rounds(final=True)
            return self._finish(final)
        finally:
            if self.pending is not None and self.pending.step.action == "pause_node":
                paused = self.pending.step.target
                if paused and self.cluster.nodes[paused].poll() is None:
                    self.cluster.nodes[paused].send_signal(signal.SIGCONT)
            self.cluster.stop()

    def _done(self, steps: list[Step]) -> bool:
        s = self.status
        finished = s is not None and s.state == RoundState.FINISHED
        exited = all(p.poll() is not None for p in self.cluster.nodes.values())
        return finished and not steps and self.pending is None and exited

    def _finish(self, s: StatusView) -> dict[str, Any]:
        records = self._check_reports(s)
        logs = sorted((self.root / "logs").glob("coordinator-*.log"))
        self.failures.update(check_close_logs(logs))
        self.failures.update(check_checkpoint(s, self.bucket, self.cluster.prefix))
        self.failures.update(check_retention(s, self.bucket, self.cluster.prefix))
        rejoined = rejoins(logs)
        self.failures.update(check_recovery(self.sc, s, rejoined))
        done = closed(s)
        last = done[-1] if done else None
        ref = reference_fingerprint(s, last.round) if last else None
        losses = [
            rep.eval_loss
            for node, rep in (last.reports.items() if last else [])
            if rep.eval_loss is not None and rep.fingerprint == ref
        ]
        return {
            "scenario": self.sc.name,
            "nodes": self.sc.nodes,
            "rounds": self.sc.run.rounds,
            "run": self.sc.run.model_dump(mode="json"),
            "faults": fault_list(self.sc),
            "events": self.events,
            "rounds_closed": len(done),
            "agreement": records,
            "gather": {r.round: r.gather for r in done},
            "excluded": {r.round: r.excluded for r in done if r.excluded},
            "recovery": recovery(self.sc, s, rejoined),
            "checkpoint": s.checkpoint.model_dump(mode="json") if s.checkpoint else None,
            "final_eval_loss": sum(losses) / len(losses) if losses else None,
            "trajectory": trajectory(s),
            "failures": [str(f) for f in sorted(self.failures)],
            "wall_s": round(time.monotonic() - self.t0, 1),
        }


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
