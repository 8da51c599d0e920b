"""``sparseloco doctor`` when something is down: the whole checklist, the right FAIL, exit 1.

Real processes: a store of the module's own (SeaweedFS, so stopping it disturbs no other test), a
coordinator process, and the ``sparseloco doctor`` console script as a participant types it.
Each case breaks one thing: the store stopped behind a live coordinator, no coordinator at the
address, a token the coordinator does not know. In every case the output lists every check,
names the failed one with its cause and fix, shows no exception repr, and the exit status is 1
(2 is kept for usage errors).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from node.cluster.seaweed import EmbeddedStore, free_ports
from protocol.runconfig import RunConfig
from support.cluster import Cluster

SPARSELOCO = str(Path(sys.executable).parent / "sparseloco")
#: Every line doctor prints for a run without a dataset, in order.
CHECKLIST = ["coordinator", "clock", "token", "store", "disk", "memory", "threads", "gpu"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EmbeddedStore, Cluster]]:
    root = tmp_path_factory.mktemp("doctor")
    own = EmbeddedStore(root / "store")
    own.start()
    cluster = Cluster(root, own, RunConfig(name="doctor", model="tiny", rounds=2), nodes=1)
    try:
        cluster.start_coordinator()
        yield own, cluster
    finally:
        cluster.stop()
        own.stop()


def doctor(url: str, token: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARSELOCO_NODE_")}
    env.update(SPARSELOCO_NODE_TOKEN=token, OMP_NUM_THREADS="1")
    return subprocess.run(
        [SPARSELOCO, "doctor", "--coordinator", url],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def lines(out: str) -> dict[str, str]:
    """Check name -> its line (level and detail), from doctor's stdout."""
    found = {}
    for line in out.splitlines():
        m = re.match(r"\s*(ok|warn|FAIL|--)\s+(\w+)\s+(.*)", line)
        if m:
            found[m.group(2)] = f"{m.group(1)} {m.group(3)}"
    return found


def checked(proc: subprocess.CompletedProcess[str], failed: str) -> dict[str, str]:
    """Common to every case: exit 1, the whole list, one FAIL, its fix, no repr, no token."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    found = lines(proc.stdout)
    assert list(found) == CHECKLIST, out
    assert [n for n, v in found.items() if v.startswith("FAIL")] == [failed], out
    fail_at = proc.stdout.splitlines().index(
        next(x for x in proc.stdout.splitlines() if "FAIL" in x)
    )
    assert "fix:" in proc.stdout.splitlines()[fail_at + 1], out
    assert f"failed: {failed}" in proc.stdout
    assert "Error(" not in out and "Traceback" not in out and "sparseloco: error" not in out
    return found


def test_the_store_down_behind_a_live_coordinator_is_named(setup) -> None:
    own, cluster = setup
    own.stop()
    try:
        proc = doctor(cluster.url, cluster.tokens["node-0"])
    finally:
        own.start()
    found = checked(proc, "store")
    assert found["coordinator"].startswith("ok") and found["token"].startswith("ok")
    assert "the coordinator answers, but its object store does not" in found["store"]
    assert "the run's operator must start or fix the object store" in proc.stdout
    assert "WARNING" not in proc.stderr  # no retry lines: the checklist says it


def test_no_coordinator_at_the_address(setup) -> None:
    (port,) = free_ports(1)
    proc = doctor(f"http://127.0.0.1:{port}", "t" * 20)
    found = checked(proc, "coordinator")
    assert f"did not answer: connection refused by 127.0.0.1:{port}" in found["coordinator"]
    for name in ("clock", "token", "store"):
        assert found[name] == "-- not checked: the coordinator did not answer"
    assert found["disk"].startswith("--") and "free at" in found["disk"]


def test_an_address_that_answers_as_something_else_is_named_so(setup) -> None:
    """The store's port given instead of the coordinator's: it answers (403), so doctor says
    that it answered, and as what, instead of "did not answer"."""
    own, _ = setup
    proc = doctor(own.endpoint.endpoint_url, "t" * 20)
    found = checked(proc, "coordinator")
    assert "answered HTTP 403" in found["coordinator"], found["coordinator"]
    assert "not as a sparseloco coordinator" in found["coordinator"]
    assert "did not answer" not in found["coordinator"]


def test_a_token_the_coordinator_does_not_know(setup) -> None:
    _, cluster = setup
    token = "not-a-token-of-this-run-0123"
    proc = doctor(cluster.url, token)
    found = checked(proc, "token")
    assert "the coordinator refused it" in found["token"] and "401" in found["token"]
    assert found["store"] == "-- not checked: it needs a token the coordinator accepts"
    assert "token add" in proc.stdout and token not in proc.stdout + proc.stderr


def test_the_link_line_says_whether_a_payload_gets_in_within_the_budget() -> None:
    """doctor's ``link`` check, from the probe's upload rate and the round's budget, as the node
    will plan it: a whole payload, fewer entries per tile, or nothing (a warning, not a FAIL)."""
    from node.tools.doctor import Doctor
    from protocol.messages import RoundState, RoundView
    from protocol.status import StatusView

    run = RunConfig(name="doctor-link", model="base")
    probe = 4 << 20

    def line(up_bytes_per_s: float, budget_s: float | None) -> tuple[str, str]:
        d = Doctor("http://coordinator.invalid", None, None)
        d.status = StatusView(
            run_id=run.run_id, run=run, round=1, state=RoundState.OPEN, members=[], rounds=[]
        )
        d.view = RoundView(
            run_id=run.run_id, round=1, state=RoundState.OPEN, expected=True, budget_s=budget_s
        )
        d._link(probe, probe / up_bytes_per_s)
        (check,) = d.checks
        assert check.name == "link"
        return check.level, check.detail

    level, detail = line(10e6, 30.0)  # 10 MB/s: a 200 kB payload in 0.02 s
    assert level == "ok" and "within the round's budget of 30.0 s" in detail
    level, detail = line(20e3, 10.0)  # 20 kB/s: 10 s for the whole payload, 5 s would fit
    assert level == "ok" and "entries per tile" in detail
    level, detail = line(100.0, 10.0)  # 100 B/s: not even one entry per tile gets in
    assert level == "warn" and "apply every round and send nothing" in detail
    level, detail = line(100.0, None)
    assert level == "ok" and "no time budget yet" in detail
