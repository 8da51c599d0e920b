"""Node tokens with real processes: SeaweedFS, ``python -m coordinator`` and ``python -m node``.

- The operator revokes a node while it trains, with the console script a user types
  (``sparseloco coordinator token revoke``): the node learns it from its next heartbeat, leaves
  with exit status 2 and one line that says why, the open round stops waiting for it, and
  ``/metrics`` drops its live figures. After training that round the node would pause for an
  hour before its next request (``slow:3600@1``, ``node.daemon.faults``), so only the heartbeat
  can tell it in time: a node that learnt of it at its next request would outlast the safety
  net.
- A second process started with a token a live process holds is refused at once (exit status
  2, a line naming ``token_in_use`` and what to do) and the first keeps its place; a restart of
  the node on its own state directory after a crash (kill -9) takes over at once, with no wait
  for the heartbeat timeout, and the run finishes with it.

Every wait is keyed to what the processes report; the timeouts are only a safety net. The
seconds the revoke command and the refused process took are printed (``pytest -s``), never
asserted: they depend on the machine.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from node.cluster.launch import start_node
from node.cluster.process import Process
from node.cluster.seaweed import EmbeddedStore
from protocol.messages import Exclusion, MemberState, RoundState
from protocol.runconfig import RunConfig, Timing
from support.cluster import Cluster

T = TypeVar("T")

#: Safety net for one wait (a node exiting, a figure leaving /metrics): far beyond the few
#: heartbeat intervals each takes, so a loaded machine does not decide the verdict.
SAFETY_S = 180.0
#: A short heartbeat interval (timeout / 4 = 3 s), so the revoked node hears it soon.
QUICK = Timing(first_round_s=300, min_round_s=120, max_round_s=300, heartbeat_timeout_s=12)
#: The usual heartbeat timeout: a restart that had to wait it out would show in the log.
PATIENT = Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=30)


@pytest.fixture
def cluster_factory(tmp_path: Path, store: EmbeddedStore) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(run: RunConfig, nodes: int) -> Cluster:
        c = Cluster(tmp_path, store, run, nodes)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


def _wait(what: str, probe: Callable[[], T | None], alive: list[Process]) -> T:
    """``probe()``'s first value that is not None; fails if a process in ``alive`` dies."""
    deadline = time.monotonic() + SAFETY_S
    while time.monotonic() < deadline:
        value = probe()
        if value is not None:
            return value
        for proc in alive:
            assert proc.poll() is None, f"{what}: a process exited early:\n{proc.tail(30)}"
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that have exited."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _live_figures(text: str, node: str) -> list[str]:
    """The node's gauge lines in ``/metrics`` (counters end in ``_total`` or ``_created``)."""
    return [
        line
        for line in text.splitlines()
        if f'node="{node}"' in line and "_total{" not in line and "_created{" not in line
    ]


def test_a_node_revoked_while_it_trains_leaves_at_its_next_heartbeat(cluster_factory) -> None:
    run = RunConfig(
        name="revoke-it", model="tiny", rounds=40, inner_steps=300, batch_size=4, min_nodes=1,
        timing=QUICK,
    )  # fmt: skip
    cluster = cluster_factory(run, 2)
    cluster.start_coordinator()
    # More rounds than node-1 trains before the test ends: it stays alive throughout.
    cluster.start_node("node-0", faults="slow:3600@1")
    cluster.start_node("node-1")
    coordinator = cluster.coordinator
    assert coordinator is not None
    victim, other = cluster.nodes["node-0"], cluster.nodes["node-1"]

    # Round 0 reported: node-0's figures are on /metrics, and it trains round 1.
    def reported() -> str | None:
        text = _metrics(cluster.url)
        return text if 'sparseloco_node_tokens_per_second{node="node-0"}' in text else None

    _wait("node-0's round-0 figures", reported, [victim, other, coordinator])

    command = [str(Path(sys.executable).parent / "sparseloco"), "coordinator", "token"]
    cpu_before = _children_cpu_s()  # the cluster's processes still run: only this one counts
    start = time.monotonic()
    revoked = subprocess.run(
        [*command, "revoke", "node-0", "--config", str(cluster.config)],
        capture_output=True, text=True, timeout=SAFETY_S,
    )  # fmt: skip
    took_s = time.monotonic() - start
    cpu_s = _children_cpu_s() - cpu_before
    assert revoked.returncode == 0, revoked.stderr
    assert "revoked 1 token of node-0" in revoked.stdout

    code = _wait("node-0 to exit", victim.poll, [other, coordinator])
    exited_s = time.monotonic() - start
    mid_training = "event=trained node=node-0 round=1" not in victim.output()
    print(
        f"\ntoken revoke returned in {took_s:.2f} s ({cpu_s:.2f} s of CPU); node-0 exited"
        f" {exited_s:.1f} s after it started, {'in' if mid_training else 'after'} training"
    )
    assert code == 2, victim.tail(20)
    last = victim.tail(1)
    assert "revoked this node's token (401 token_revoked)" in last, victim.tail(20)
    assert "ask the operator for a new token" in last
    assert "Traceback" not in victim.output()
    assert cluster.tokens["node-0"] not in victim.output()  # the refusal shows no secret

    # Out of the run: the round it trained closes without it, and its live figures are gone.
    def closed_without_it() -> bool | None:
        status = cluster.status()
        states = {m.node_id: m.state for m in status.members}
        revoked_in = [
            r for r in status.rounds
            if r.state == RoundState.CLOSED and r.excluded.get("node-0") == Exclusion.REVOKED
        ]  # fmt: skip
        return True if states["node-0"] == MemberState.REVOKED and revoked_in else None

    _wait("a round closed without node-0", closed_without_it, [other, coordinator])
    text = _metrics(cluster.url)
    assert _live_figures(text, "node-0") == [], _live_figures(text, "node-0")
    assert 'sparseloco_node_tokens_per_second{node="node-1"}' in text  # the other one stays
    assert 'sparseloco_node_bytes_total{direction="up",node="node-0"}' in text  # its history
    assert other.poll() is None  # node-1 trains on


def test_a_second_process_is_refused_at_once_and_a_restart_takes_over(cluster_factory) -> None:
    # min_nodes=2 keeps round 0 waiting, so node-0 idles as an active member meanwhile.
    run = RunConfig(
        name="in-use-it", model="tiny", rounds=2, inner_steps=5, batch_size=4, min_nodes=2,
        timing=PATIENT,
    )  # fmt: skip
    cluster = cluster_factory(run, 2)
    cluster.start_coordinator()
    first = cluster.start_node("node-0")
    cluster.wait_for("node-0 to join", lambda s: [m.node_id for m in s.members] == ["node-0"])

    # The same token on another state directory: a mistake, told at once.
    cpu_before = _children_cpu_s()
    start = time.monotonic()
    second = start_node(
        "node-0-second",
        cluster.url,
        cluster.tokens["node-0"],
        cluster.root / "nodes" / "node-0-second",
        cluster.root / "logs" / "node-0-second.log",
        None,
    )
    try:
        code = _wait("the second process to exit", second.poll, [first])
    finally:
        second.stop(timeout=20)
    took_s, cpu_s = time.monotonic() - start, _children_cpu_s() - cpu_before
    print(f"\nthe second process exited with {code} after {took_s:.1f} s ({cpu_s:.1f} s of CPU)")
    assert code == 2, second.tail(20)
    last = second.tail(1)
    assert "409 token_in_use" in last and "One token serves one node process" in last, last
    assert "waiting" not in second.output()
    assert cluster.tokens["node-0"] not in second.output()
    coordinator_log = (cluster.root / "logs" / "coordinator-1.log").read_text()
    assert "event=token_in_use node=node-0" in coordinator_log
    status = cluster.status()
    assert [(m.node_id, m.state) for m in status.members] == [("node-0", MemberState.ACTIVE)]
    assert "event=rejoin" not in first.output()  # the first process never lost its place

    # node-0 crashes and is restarted on its own state directory: it takes over at once.
    first.kill()
    restarted = cluster.start_node("node-0")
    cluster.start_node("node-1")
    status = cluster.wait_finished()
    assert "token_in_use" not in restarted.output()
    coordinator_log = (cluster.root / "logs" / "coordinator-1.log").read_text()
    assert "event=took_over node=node-0" in coordinator_log
    assert "event=timed_out" not in coordinator_log  # nobody waited out the heartbeat timeout
    assert {m.node_id: m.state for m in status.members} == {
        "node-0": MemberState.FINISHED,
        "node-1": MemberState.FINISHED,
    }
    closed = [r for r in status.rounds if r.state == RoundState.CLOSED]
    assert closed and all(r.gather == ["node-0", "node-1"] for r in closed)
