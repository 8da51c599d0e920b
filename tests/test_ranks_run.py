"""Nodes of 2 and 4 processes under torchrun in a real run, beside single-process nodes.

SeaweedFS, a coordinator and every node as real processes, each multi-process node started
with the README's command (``sparseloco node --ranks N ...``), one of them with the guide's
torchrun line (``torchrun --standalone --nproc-per-node N -m node node ...``). The run goes
through what happens to such a node in the field, keyed to the run's rounds:

1. a 2-rank, a 4-rank (torchrun) and a single-process node train rounds together;
2. one rank of the 4-rank node is killed with SIGKILL: all of that node's processes end, and
   the run goes on without it;
3. the 2-rank node is stopped with SIGTERM: it leaves the run, every rank ends, exit status 0;
4. the killed node comes back with 2 ranks instead of 4 (its state is resharded) and catches
   up; a new 2-rank node joins late, from the newest checkpoint, and catches up; the stopped
   node comes back;
5. the run finishes with every node in it.

Every closed round has one fingerprint among the nodes that reported it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from node.cluster.process import Process
from node.compute.presets import get_run_preset
from protocol.messages import MemberState, RoundState
from protocol.runconfig import RunConfig, Timing
from protocol.status import StatusView
from support.cluster import Cluster, closed_count
from support.reaper import live

#: The node killed in phase 2 leaves no word: the round waits until its heartbeat times out. 12 s
#: (a beat every 3 s, as in ``test_token_processes.py``) keeps that wait short.
TIMING = Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=12)
#: Enough rounds that the phases below (each waits on processes, which a loaded machine slows
#: while tiny rounds go on) find the run still going; each phase checks that it does.
ROUNDS = 16
#: Safety net for processes that should be gone.
GONE_S = 60.0


def _rank_pids(log: str) -> dict[int, int]:
    """rank -> pid of the processes a torchrun node logged (the latest start of each rank)."""
    found = re.findall(r"event=rank_ready rank=(\d+) world=\d+ backend=\S+ pid=(\d+)", log)
    return {int(rank): int(pid) for rank, pid in found}


def _gone(pid: int) -> bool:
    return not list(live([pid]))


def _wait_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline and not all(map(_gone, pids)):
        time.sleep(0.2)
    assert all(map(_gone, pids)), f"processes still running: {[p for p in pids if not _gone(p)]}"


def _wait_ranks(proc: Process, world: int) -> dict[int, int]:
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline:
        pids = _rank_pids(proc.output())
        if len(pids) == world:
            return pids
        assert proc.poll() is None, proc.tail(40)
        time.sleep(0.2)
    raise AssertionError(f"{world} ranks never came up:\n{proc.tail(40)}")


def _gathered(status: StatusView, node: str) -> list[int]:
    return [r.round for r in status.rounds if r.state == RoundState.CLOSED and node in r.gather]


def test_torchrun_nodes_of_2_and_4_processes_train_beside_single_ones(tmp_path, store) -> None:
    shape = get_run_preset("tiny")
    run = RunConfig(
        name="ranks", model=shape.model, rounds=ROUNDS, inner_steps=shape.inner_steps,
        batch_size=shape.batch_size, min_nodes=2, checkpoint_every=3, retention_rounds=4,
        timing=TIMING,
    )  # fmt: skip
    cluster = Cluster(tmp_path, store, run, 4)
    try:
        cluster.start_coordinator()
        two = cluster.start_node("node-0", ranks=2)
        four = cluster.start_node("node-1", ranks=4, torchrun=True)
        cluster.start_node("node-2")
        first_two, first_four = _wait_ranks(two, 2), _wait_ranks(four, 4)
        cluster.wait_for(
            "2 rounds with all three nodes",
            lambda s: sum(1 for r in s.rounds if len(r.gather) == 3) >= 2,
        )

        # kill -9 of one rank of the 4-process node: the whole node ends, the run goes on.
        before_kill = closed_count(cluster.status())
        del cluster.nodes["node-1"]
        os.kill(first_four[2], signal.SIGKILL)
        assert four.popen.wait(timeout=GONE_S) != 0
        _wait_gone(list(first_four.values()))
        done = closed_count(cluster.status())
        assert done < run.rounds - 3, f"the run closed {done} rounds while node-1 went down"
        cluster.wait_closed(done + 1)

        # SIGTERM to the 2-process node (its whole process group, as systemd sends it): every
        # rank ends cleanly (the node leaves, rank 0 releases rank 1), and the node exits 0.
        del cluster.nodes["node-0"]
        assert two.stop(timeout=GONE_S) == 0, two.tail(30)
        log = two.output()
        assert "event=stop_requested node=node-0" in log and "event=left node=node-0" in log
        assert "event=rank_stopped rank=1" in log, log[-3000:]
        _wait_gone(list(first_two.values()))

        # Back with another rank count, a late joiner, and the stopped node again.
        done = closed_count(cluster.status())
        assert done < run.rounds - 2, f"the run closed {done} rounds before the nodes came back"
        four_again = cluster.start_node("node-1", ranks=2)
        late = cluster.start_node("node-3", ranks=2)
        cluster.start_node("node-0", ranks=2)
        status = cluster.wait_finished()
    finally:
        cluster.stop()
    assert "event=state_resharded from_world=4 to_world=2" in four_again.output()
    assert "event=checkpoint_loaded node=node-3" in late.output(), late.tail(40)
    closed = [r for r in status.rounds if r.state == RoundState.CLOSED]
    assert [r.round for r in closed] == list(range(run.rounds))
    for summary in closed:
        assert len(set(summary.fingerprints.values())) == 1, (summary.round, summary.fingerprints)
    last = closed[-1]
    assert set(last.gather) == {"node-0", "node-1", "node-2", "node-3"}
    assert set(last.fingerprints) == {"node-0", "node-1", "node-2", "node-3"}
    # The 4-rank node's rounds counted: at least two before its kill (which ones depends on when
    # its four processes joined: round 0 opens once two nodes are in, often before it).
    assert len([r for r in _gathered(status, "node-1") if r < before_kill]) >= 2


def test_a_torchrun_node_merges_inside_a_step_beside_a_single_one(tmp_path, store) -> None:
    # The default overlap (merge a quarter into the first step) on a node of 2 processes: rank 0
    # waits at the merge for the transfers while rank 1 waits for its word, both merge their
    # tensors, and the node holds what the single-process node holds after every round.
    shape = get_run_preset("tiny")
    run = RunConfig(
        name="ranks-merge", model=shape.model, rounds=5, inner_steps=shape.inner_steps,
        batch_size=shape.batch_size, min_nodes=2, overlap="merge", timing=TIMING,
    )  # fmt: skip
    assert run.merge_step == 1 and run.merge_rows == 2  # inside the first step
    cluster = Cluster(tmp_path, store, run, 2)
    try:
        cluster.start_coordinator()
        two = cluster.start_node("node-0", ranks=2)
        cluster.start_node("node-1")
        status = cluster.wait_finished()
        assert two.popen.wait(timeout=GONE_S) == 0, two.tail(20)  # it ends with the run
        # Started again after the run finished, it finds it so and ends (its last fingerprint
        # is a collective of both processes: rank 0 alone waited for rank 1 forever).
        again = cluster.start_node("node-0", ranks=2)
        assert again.popen.wait(timeout=GONE_S * 3) == 0, again.tail(20)
    finally:
        cluster.stop()
    assert "event=run_finished node=node-0" in again.output(), again.tail(20)
    log = two.output()
    closed = [r for r in status.rounds if r.state == RoundState.CLOSED]
    assert [r.round for r in closed] == list(range(run.rounds))
    for summary in closed:
        assert set(summary.gather) == {"node-0", "node-1"}, (summary.round, summary.gather)
        assert len(set(summary.fingerprints.values())) == 1, (summary.round, summary.fingerprints)
    assert set(closed[-1].fingerprints) == {"node-0", "node-1"}
    # Every round after the first was trained beside the previous one and merged into it.
    assert len(re.findall(r"event=trained .*beside=\d+", log)) == run.rounds - 1, log[-3000:]
    assert "merge_abandoned" not in log and "Traceback" not in log, log[-3000:]


def test_a_node_of_2_processes_revoked_exits_2_with_one_line(tmp_path, store) -> None:
    # ``sparseloco coordinator token revoke`` of a 2-process node mid-run: rank 0 hears it at
    # its next heartbeat and says so in one line; rank 1 is released, not left to find rank 0
    # gone (whose advice, "restart with the same command", would be wrong for a revoked token).
    shape = get_run_preset("tiny")
    run = RunConfig(
        name="ranks-revoke", model=shape.model, rounds=ROUNDS, inner_steps=shape.inner_steps,
        batch_size=shape.batch_size, min_nodes=2, timing=TIMING,
    )  # fmt: skip
    cluster = Cluster(tmp_path, store, run, 2)
    try:
        cluster.start_coordinator()
        two = cluster.start_node("node-0", ranks=2)
        cluster.start_node("node-1")
        pids = _wait_ranks(two, 2)
        cluster.wait_for("a round with both nodes", lambda s: _gathered(s, "node-0") != [])
        sparseloco = str(Path(sys.executable).parent / "sparseloco")
        revoke = ["coordinator", "token", "revoke", "node-0", "--config", str(cluster.config)]
        revoked = subprocess.run(
            [sparseloco, *revoke], capture_output=True, text=True, timeout=GONE_S
        )
        assert revoked.returncode == 0, revoked.stderr
        code = two.popen.wait(timeout=GONE_S)
        _wait_gone(list(pids.values()))
    finally:
        cluster.stop()
    log = two.output()
    assert code == 2, log[-3000:]
    # The lines for the user (the logs' are timestamped): one, from rank 0.
    said = [line for line in log.splitlines() if line.startswith("sparseloco")]
    errors = [line for line in log.splitlines() if " ERROR " in line or "error:" in line]
    assert said == errors and len(errors) == 1, errors
    assert "revoked this node's token (401 token_revoked)" in errors[0]
    assert "Traceback" not in log and "same command" not in log, log[-3000:]
    assert "event=rank_stopped rank=1" in log, log[-3000:]


def test_a_node_of_more_processes_than_the_batch_has_rows_says_so_once(tmp_path, store) -> None:
    # A run of batch 2 and a node of 3 processes: rank 0 learns the batch at its join and says
    # so before any process builds anything; the others are released, not left to fail alike.
    shape = get_run_preset("tiny")
    run = RunConfig(
        name="ranks-rows", model=shape.model, rounds=3, inner_steps=shape.inner_steps,
        batch_size=2, min_nodes=1, timing=TIMING,
    )  # fmt: skip
    cluster = Cluster(tmp_path, store, run, 1)
    try:
        cluster.start_coordinator()
        three = cluster.start_node("node-0", ranks=3)
        code = three.popen.wait(timeout=GONE_S * 3)
        status = cluster.status()
    finally:
        cluster.stop()
    log = three.output()
    said = [line for line in log.splitlines() if line.startswith("sparseloco")]
    assert code == 2 and len(said) == 1, log[-3000:]
    assert "batch_size 2 is smaller than this node's 3 processes" in said[0]
    assert "start the node with --ranks 2 or fewer" in said[0]
    assert "Traceback" not in log
    assert [m.state for m in status.members if m.node_id == "node-0"] == [MemberState.LEFT]
