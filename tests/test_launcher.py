"""``sparseloco node --ranks N``'s launcher (``node.daemon.launcher``): real processes.

The node's processes are small Python scripts here (each writes down the place the launcher gave
it, then does what the test asks); the launcher runs in a process of its own, as the command
runs it, so the signals sent to it are real. The whole node under the launcher, in a real run,
is in ``tests/test_ranks_run.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from node.daemon.launcher import exit_status, rank_env, started_world
from support.reaper import live

#: Safety net for a process that should end.
WAIT_S = 60.0

#: One process of the node: writes its environment's place, then follows ``SPARSELOCO_TEST_DO``.
CHILD = r"""
import json, os, signal, sys, time
place = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                    "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")}
place["pid"] = os.getpid()
out = os.environ["SPARSELOCO_TEST_OUT"]
do = os.environ.get("SPARSELOCO_TEST_DO", "")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
stops = []
def stop(signum, frame):
    stops.append(signum)
def others_ready():  # each has set its handlers (below) before its place file appears
    while not all(os.path.exists(f"{out}/rank{r}.json") for r in range(world)):
        time.sleep(0.02)
if "ignore-term" in do and rank != 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
with open(f"{out}/rank{rank}.tmp", "w") as f:
    json.dump(place, f)
os.replace(f"{out}/rank{rank}.tmp", f"{out}/rank{rank}.json")
if "rank0-refused" in do and rank == 0:
    others_ready()
    print("sparseloco: error: refused", file=sys.stderr)
    sys.exit(2)
if "rank1-killed" in do and rank == 1:
    others_ready()
    os.kill(os.getpid(), signal.SIGKILL)
while not stops:
    time.sleep(0.05)
with open(f"{out}/rank{rank}.stopped", "w") as f:
    f.write(str(len(stops)))
"""

#: The launcher as ``sparseloco node --ranks`` runs it, with a short grace for the tests.
LAUNCH = r"""
import sys
from node.daemon import launcher
launcher.GRACE_S = 1.0
world = int(sys.argv[1])
sys.exit(launcher.Launcher([sys.executable, "-c", sys.argv[2]], world).run())
"""


def _launch(tmp_path: Path, world: int, do: str = "") -> subprocess.Popen[str]:
    env = dict(os.environ, SPARSELOCO_TEST_OUT=str(tmp_path), SPARSELOCO_TEST_DO=do)
    env.pop("OMP_NUM_THREADS", None)
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(world), CHILD],
        env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _end(launcher: subprocess.Popen[str]) -> tuple[int, str]:
    """The launcher's exit status and what it (and its processes) wrote to stderr."""
    _, stderr = launcher.communicate(timeout=WAIT_S)
    return launcher.returncode, stderr or ""


def _places(tmp_path: Path, world: int) -> list[dict]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        files = [tmp_path / f"rank{r}.json" for r in range(world)]
        if all(f.exists() for f in files):  # each one's handlers are set by then
            return [json.loads(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError("the node's processes never started")


def _gone(pid: int) -> bool:
    return not list(live([pid]))


def test_each_process_gets_its_place_as_torchrun_gives_it(tmp_path: Path) -> None:
    launcher = _launch(tmp_path, 3)
    places = _places(tmp_path, 3)
    launcher.send_signal(signal.SIGTERM)
    code, stderr = _end(launcher)
    assert code == 0, stderr
    assert [p["RANK"] for p in places] == ["0", "1", "2"]
    assert [p["LOCAL_RANK"] for p in places] == ["0", "1", "2"]
    assert {p["WORLD_SIZE"] for p in places} == {"3"} == {p["LOCAL_WORLD_SIZE"] for p in places}
    assert {p["MASTER_ADDR"] for p in places} == {"127.0.0.1"}
    assert len({p["MASTER_PORT"] for p in places}) == 1  # one rendezvous
    share = str(max(1, (os.cpu_count() or 1) // 3))
    assert {p["OMP_NUM_THREADS"] for p in places} == {share}


def test_sigterm_to_the_launcher_alone_stops_every_process_and_exits_0(tmp_path: Path) -> None:
    # A supervisor that signals only the main process: the launcher passes it on once.
    launcher = _launch(tmp_path, 2)
    _places(tmp_path, 2)
    launcher.send_signal(signal.SIGTERM)
    assert _end(launcher) == (0, "")  # and nothing of its own to say
    assert [(tmp_path / f"rank{r}.stopped").read_text() for r in range(2)] == ["1", "1"]


def test_sigterm_to_the_whole_group_is_one_stop_and_exits_0(tmp_path: Path) -> None:
    # systemd's default (every process of the unit) or a terminal's Ctrl-C: each process hears
    # the signal twice (directly and passed on), and the node still stops as asked.
    env = dict(os.environ, SPARSELOCO_TEST_OUT=str(tmp_path))
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, "2", CHILD], env=env, start_new_session=True
    )
    _places(tmp_path, 2)
    os.killpg(launcher.pid, signal.SIGINT)
    assert launcher.wait(timeout=WAIT_S) == 0
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.stopped").exists()


def test_the_node_exits_with_rank_0s_status_and_the_others_are_ended(tmp_path: Path) -> None:
    # Rank 0 exits 2 (refused, its one line said why); rank 1 ends on the launcher's SIGTERM.
    launcher = _launch(tmp_path, 2, do="rank0-refused")
    code, stderr = _end(launcher)
    assert code == 2
    assert stderr.strip().splitlines() == ["sparseloco: error: refused"]  # rank 0's line only
    assert (tmp_path / "rank1.stopped").exists()


def test_a_process_that_does_not_end_is_killed_after_the_grace(tmp_path: Path) -> None:
    # Rank 1 ignores SIGTERM, as a process stuck in a collective might: SIGKILL after twice
    # the grace, said in one line, and the node still exits with rank 0's status.
    launcher = _launch(tmp_path, 2, do="rank0-refused,ignore-term")
    pids = [p["pid"] for p in _places(tmp_path, 2)]
    code, stderr = _end(launcher)
    assert code == 2
    assert "process 1 of the node's 2 did not end" in stderr and "killed" in stderr, stderr
    assert _gone(pids[1])


def test_a_process_killed_by_a_signal_is_named_and_the_node_exits_1(tmp_path: Path) -> None:
    launcher = _launch(tmp_path, 3, do="rank1-killed")
    code, stderr = _end(launcher)
    assert code == 1
    assert "process 1 of the node's 3 was killed by SIGKILL" in stderr
    assert "same --state-dir resumes the node" in stderr
    for rank in (0, 2):
        assert (tmp_path / f"rank{rank}.stopped").exists()


def test_a_killed_launcher_takes_its_processes_with_it(tmp_path: Path) -> None:
    launcher = _launch(tmp_path, 2)
    pids = [p["pid"] for p in _places(tmp_path, 2)]
    launcher.kill()
    _end(launcher)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not all(map(_gone, pids)):
        time.sleep(0.05)
    assert all(map(_gone, pids))
    for rank in range(2):  # each was told (SIGTERM), so it could stop cleanly
        assert (tmp_path / f"rank{rank}.stopped").exists()


@pytest.mark.parametrize(
    ("codes", "passed_on", "status", "says"),
    [
        ([0, 0], False, 0, None),  # finished
        ([0, 0, 0, 0], True, 0, None),  # stopped by a signal, cleanly
        ([2, 0], False, 2, None),  # refused: rank 0's status and line
        ([130, 0], True, 130, None),  # Ctrl-C before rank 0's handlers were set
        ([0, 1], False, 1, None),  # a follower failed
        ([1, -9, 1], False, 1, "process 1 of the node's 3 was killed by SIGKILL"),
        ([-15, 0], True, 0, None),  # killed by the stop signal passed on: stopped as asked
        ([-15, 0], False, 1, "process 0 of the node's 2 was killed by SIGTERM"),
    ],
)
def test_exit_status(codes: list[int], passed_on: bool, status: int, says: str | None) -> None:
    code, line = exit_status(codes, passed_on, forced=set())
    assert code == status
    assert (line is None) if says is None else (line is not None and says in line)


def test_a_process_the_launcher_killed_is_not_reported_as_killed() -> None:
    assert exit_status([2, -9], False, forced={1}) == (2, None)
    assert exit_status([0, -9], False, forced={1}) == (1, None)


def test_rank_env_and_started_world() -> None:
    env = rank_env(1, 4, 29500, {"PATH": "/bin"}, threads=3)
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "4" and env["MASTER_PORT"] == "29500"
    assert env["OMP_NUM_THREADS"] == "3" == env["NUMBA_NUM_THREADS"]  # --threads sizes the pools
    assert rank_env(0, 2, 1, {"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"  # the user's
    # No --threads (the settings' 0): the cores shared out, never 0 (numba refuses to start).
    share = str(max(1, (os.cpu_count() or 1) // 2))
    unset = rank_env(0, 2, 1, {}, threads=0)
    assert unset["OMP_NUM_THREADS"] == share == unset["NUMBA_NUM_THREADS"]
    assert started_world(env) == 4
    assert started_world({"PATH": "/bin"}) == 0
    assert started_world({"TORCHELASTIC_RUN_ID": "x"}) == 1


def test_up_starts_plain_nodes_unless_ranks_are_asked_and_then_even_one() -> None:
    # `up --ranks 1,2`: node 0 is a node of one process under the launcher (its outer state on
    # its device), node 1 of two; without --ranks every node is one plain process.
    from node.cluster.launch import node_command
    from node.cluster.up import UpConfig

    plain, ranked = UpConfig(), UpConfig(ranks="1,2")
    assert [plain.node_ranks(i) for i in range(3)] == [None, None, None]
    assert [ranked.node_ranks(i) for i in range(3)] == [1, 2, 1]
    url = "http://127.0.0.1:8700"
    assert node_command(url)[-4:] == ["node", "node", "--coordinator", url]
    assert node_command(url, 1)[-2:] == ["--ranks", "1"]
    torchrun = node_command(url, 2, torchrun=True)
    assert "--nproc-per-node=2" in torchrun and "--ranks" not in torchrun
