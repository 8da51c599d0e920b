"""Integration: the coordinator's host is lost, and a copy on "another host" carries the run on.

Real processes only: SeaweedFS, ``python -m coordinator``, two ``python -m node`` nodes, the
tiny model. A backup is taken with the operator's command while the run goes (round 3 open);
the run goes on for three more rounds (the copy is now behind: those rounds exist only in the
dead coordinator's database, in the store and in the nodes' state); with round 6 open and
node-0's payload submitted to it, the coordinator is killed with SIGKILL; the
backup is restored into a fresh state directory and a coordinator started there with the same
config on the same port (the host moved behind the same name). The nodes are never restarted:
they keep their pinned manifest key, the restored coordinator learns the two rounds from the
store's signed manifests, a submission it never saw is sent again, and the run finishes with
every closed round applied identically by both nodes.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from node.cluster.launch import start_coordinator
from protocol.messages import RoundState
from protocol.runconfig import RunConfig, Timing
from support.cluster import WAIT_S, Cluster

SPARSELOCO = Path(sys.executable).parent / "sparseloco"
TIMING = Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=30)
RUN = RunConfig(
    name="restore",
    model="tiny",
    rounds=10,
    inner_steps=5,
    batch_size=4,
    min_nodes=2,
    overlap="off",
    timing=TIMING,
)
#: node-1 sleeps this long after training rounds 3 and 6, before it uploads: each of those
#: rounds stays open that long (its deadline is at least ``min_round_s``), which holds the run
#: still while the backup is taken (round 3; the command takes about a second) and while the
#: coordinator is killed (round 6; the kill waits for node-0's submission, which takes less).
STALL_S = 12
STALLS = f"slow:{STALL_S}@3,slow:{STALL_S}@6"
#: The longest the coordinator holds a manifest long-poll (``[server]``, 60 s by default): the
#: restored one answers node-0's with "open, nothing from you" that much later, and node-0 only
#: then sends its lost submission again; a few seconds keep that inside node-1's stall.
MANIFEST_WAIT_S = 3.0


@pytest.fixture
def cluster(tmp_path: Path, store):
    c = Cluster(tmp_path, store, RUN, 2, server={"manifest_wait_max_s": MANIFEST_WAIT_S})
    yield c
    c.stop()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SPARSELOCO), "coordinator", *args], capture_output=True, text=True, timeout=120
    )


def _applied(cluster: Cluster, node: str) -> dict[int, str]:
    """round -> fingerprint of θ after it, as ``node`` logged applying it."""
    text = (cluster.root / "logs" / f"{node}.log").read_text()
    found = re.findall(r"event=applied node=\S+ .*?applied_round=(\d+) .*?fingerprint=(\w+)", text)
    return {int(r): fp for r, fp in found}


def _kill_once_published(cluster: Cluster) -> int:
    """SIGKILL the coordinator at a moment when every round it closed is in the store and
    node-0 has submitted to the open round; the number of closed rounds then.

    A round closed and answered but not yet uploaded cannot be learnt by a restored copy (README
    says so); the publisher uploads within milliseconds, so the test stops the process
    (SIGSTOP), looks, and kills it only when nothing is pending: keyed to state, not to time.
    node-0's submission is one the restored coordinator never sees: node-0 sends it again.
    """
    proc = cluster.coordinator
    assert proc is not None
    db = cluster.state_dir / "coordinator.sqlite"
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        os.kill(proc.pid, signal.SIGSTOP)
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
        try:
            closed, pending = conn.execute(
                "SELECT COUNT(*), COALESCE(SUM(published=0), 0) FROM rounds WHERE state='closed'"
            ).fetchone()
            (submitted,) = conn.execute(
                "SELECT COUNT(*) FROM submissions WHERE node_id='node-0'"
                " AND round=(SELECT MAX(round) FROM rounds WHERE state='open')"
            ).fetchone()
        finally:
            conn.close()
        if pending == 0 and submitted == 1:
            proc.kill()  # SIGKILL: no chance to flush anything
            return int(closed)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("the coordinator never had every closed round published")


def test_a_restored_backup_carries_the_run_on_without_restarting_nodes(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start_coordinator()
    cluster.start_node("node-0")
    cluster.start_node("node-1", faults=STALLS)
    nodes = dict(cluster.nodes)
    cluster.wait_closed(3)  # round 3 is open now, and stays open while node-1 sleeps

    backup = tmp_path / "offsite" / "coordinator.tar.gz"
    made = _cli("backup", "--config", str(cluster.config), "--out", str(backup))
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE(backup.stat().st_mode) == 0o600
    key_pem = (cluster.state_dir / "manifest-key.pem").read_text()
    assert key_pem.splitlines()[1] not in made.stdout + made.stderr
    backed_up = int(re.search(r"at round (\d+)", made.stdout).group(1))  # type: ignore[union-attr]

    # The run goes on past the backup (the copy is behind the live coordinator) to round 6.
    cluster.wait_closed(6)
    closed_at_kill = _kill_once_published(cluster)
    assert closed_at_kill >= backed_up + 2
    assert closed_at_kill < RUN.rounds, "the run ended before the kill; nothing to carry on"

    # "Another host": a fresh state directory, the same config, the same address.
    other = tmp_path / "other-host" / "coordinator"
    restored = _cli("restore", "--from", str(backup), "--state-dir", str(other))
    assert restored.returncode == 0, restored.stderr
    port = urlparse(cluster.url).port
    assert port is not None
    cluster.state_dir = other
    cluster.coordinator, url = start_coordinator(
        cluster.config,
        other,
        cluster.root / "logs" / "coordinator-restored.log",
        port=port,
        extra_args=["--state-dir", str(other)],
    )
    assert url == cluster.url

    status = cluster.wait_finished()  # also: both nodes exited 0
    for name, proc in nodes.items():
        assert cluster.nodes[name] is proc, f"{name} was restarted"
        log = (cluster.root / "logs" / f"{name}.log").read_text()
        assert log.count("event=joined") == 1, f"{name} joined again"
    restored_log = (cluster.root / "logs" / "coordinator-restored.log").read_text()
    learnt = re.search(r"event=rounds_learnt_from_store first=(\d+) last=(\d+)", restored_log)
    assert learnt is not None, "the restored coordinator did not learn the rounds after its backup"
    assert int(learnt.group(2)) == closed_at_kill - 1
    assert "event=round_closed" in restored_log  # it closed rounds itself afterwards
    # node-0's submission to the round open at the kill was lost with the old coordinator; it
    # sent it again and it counted. Again: either its answer had arrived before the kill (the
    # node resubmits what the restored coordinator does not know), or the kill fell between the
    # commit and the answer (the node's submit request failed, and its retry reached the new one).
    node0 = (cluster.root / "logs" / "node-0.log").read_text()
    retried = f"what='POST /v1/rounds/{closed_at_kill}/submit'"
    assert "event=resubmit" in node0 or retried in node0, node0[-3000:]

    closed = [r for r in status.rounds if r.state == RoundState.CLOSED]
    assert [r.round for r in closed] == list(range(RUN.rounds)), "a round lost or closed twice"
    assert "node-0" in closed[closed_at_kill].gather, closed[closed_at_kill]
    # Every closed round was applied by both nodes to the same θ (one fingerprint per round),
    # and what they reported to either coordinator agrees with it.
    applied = {name: _applied(cluster, name) for name in nodes}
    for r in range(RUN.rounds):
        prints = {applied[name].get(r) for name in nodes}
        assert len(prints) == 1 and None not in prints, (r, prints)
    for summary in closed:
        for node, fingerprint in summary.fingerprints.items():
            assert fingerprint == applied[node][summary.round], (summary.round, node)
