"""SIGTERM or SIGINT to pytest leaves no process of its session behind (``support.reaper``).

A pytest is started on a small test file written to ``tmp_path``, with this project's conftest
and settings. Its one test holds the session's SeaweedFS (the ``store`` fixture), a coordinator
process in a ``with`` block, and a leak no finalizer knows of: a child that starts a grandchild.
Once all are up, the test sends the signal to that pytest alone (not its group, as ``kill PID``
or a CI timeout does) and checks:

- pytest ends as interrupted (exit 2) after tearing down in order: the store and the coordinator
  are stopped by their owners, not by the last-resort sweep;
- the sweep ended the leak and its grandchild and said so;
- afterwards no process carrying this test's mark in its environment runs (every process the
  inner session started inherits it).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support.harness import REPO_ROOT
from support.reaper import live

#: Safety nets: a loaded 2-core machine takes ~20 s to start pytest, a few to start the store.
UP_S = 240.0
DOWN_S = 120.0

INNER = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from pathlib import Path

    from protocol.runconfig import RunConfig
    from support.harness import CoordinatorProcess, write_coordinator_config

    SLEEPER = "import subprocess, sys, time;" \\
        " subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);" \\
        " time.sleep(600)"


    def test_holds_processes_until_interrupted(store, tmp_path):
        state = tmp_path / "state"
        config = write_coordinator_config(
            tmp_path / "run.toml", run=RunConfig(name="sig", rounds=2),
            endpoint=store.endpoint, tokens={"n0": "signal-test-token-n0"},
            prefix="signal-test", state_dir=state,
        )
        with CoordinatorProcess(config, state) as coord:
            leak = subprocess.Popen([sys.executable, "-c", SLEEPER])
            pids = {
                "store": store.process.pid,
                "coordinator": coord.process.pid,
                "leak": leak.pid,
            }
            Path(os.environ["SIGNAL_TEST_PIDS"]).write_text(json.dumps(pids))
            time.sleep(600)
    """
)


def _marked(mark: str) -> list[int]:
    """Live pids whose environment holds ``SIGNAL_TEST_MARK=mark``."""
    want = f"SIGNAL_TEST_MARK={mark}".encode()
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                environ = Path(entry.path, "environ").read_bytes()
            except OSError:
                continue
            if want in environ.split(b"\0"):
                pids.append(int(entry.name))
    return list(live(pids))


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux's /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_pytest_ends_every_process_of_its_session(
    tmp_path: Path, sig: signal.Signals
) -> None:
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_inner.py").write_text(INNER)
    pids_file, mark = tmp_path / "pids.json", secrets.token_hex(8)
    env = dict(
        os.environ,
        SIGNAL_TEST_PIDS=str(pids_file),
        SIGNAL_TEST_MARK=mark,
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "tests"), str(REPO_ROOT)]),
    )
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    args += ["-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(inner), "-p", "conftest"]
    args += ["--basetemp", str(tmp_path / "base"), str(inner / "test_inner.py")]
    log = tmp_path / "pytest.log"
    with open(log, "wb") as out:
        pytest_proc = subprocess.Popen(args, cwd=inner, env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + UP_S
        while not pids_file.exists():
            assert pytest_proc.poll() is None, f"inner pytest ended early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"processes not up:\n{log.read_text()}"
            time.sleep(0.2)
        pids = json.loads(pids_file.read_text())
        assert sorted(live(list(pids.values()))) == sorted(pids.values())

        pytest_proc.send_signal(sig)
        code = pytest_proc.wait(timeout=DOWN_S)
        output = log.read_text(errors="replace")
        assert code == pytest.ExitCode.INTERRUPTED, output
        assert "KeyboardInterrupt" in output, output
        # The store and the coordinator were stopped in order by their owners; the sweep
        # found only the leak (the child and its grandchild).
        assert "reaper: 2 processes outlived their tests" in output, output
        swept = output.split("reaper:", 1)[1]
        assert "weed" not in swept and "coordinator" not in swept, output
        assert list(live(list(pids.values()))) == [], output
        assert _marked(mark) == [], output
    finally:
        if pytest_proc.poll() is None:
            pytest_proc.kill()
            pytest_proc.wait()
