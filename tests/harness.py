"""Helpers for integration tests that run a real coordinator process.

``write_coordinator_config`` writes the TOML a coordinator reads; ``CoordinatorProcess`` starts
``python -m coordinator`` on a free port, waits for the ``coordinator.json`` it announces, and
always stops it (SIGTERM, then SIGKILL) when the ``with`` block ends. The process log goes to
``{state_dir}/coordinator.log`` so a failing test can show it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

from node.cluster.seaweed import StoreEndpoint
from node.cluster.up import coordinator_toml
from protocol.runconfig import RunConfig

#: Seconds for the coordinator to listen after start (includes the interpreter's imports).
START_TIMEOUT_S = 60.0
#: Seconds for a clean exit after SIGTERM.
STOP_TIMEOUT_S = 30.0
REPO_ROOT = Path(__file__).resolve().parent.parent


def write_coordinator_config(
    path: str | os.PathLike[str],
    *,
    run: RunConfig,
    endpoint: StoreEndpoint,
    tokens: dict[str, str],
    prefix: str,
    state_dir: str | os.PathLike[str],
    server: dict[str, object] | None = None,
) -> Path:
    """Write a coordinator TOML config at ``path`` (``node.cluster.up.coordinator_toml``)."""
    out = Path(path)
    text = coordinator_toml(
        run, endpoint, dict(tokens), Path(state_dir), prefix=prefix, server=server
    )
    out.write_text(text + "\n")
    return out


class CoordinatorProcess:
    """``python -m coordinator --config CONFIG --port 0`` as a managed child process."""

    def __init__(
        self,
        config: str | os.PathLike[str],
        state_dir: str | os.PathLike[str],
        *,
        extra_args: list[str] | None = None,
    ) -> None:
        self.config = Path(config)
        self.state_dir = Path(state_dir)
        self.extra_args = extra_args or []
        self.log_path = self.state_dir / "coordinator.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.run_id = ""

    def start(self) -> CoordinatorProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        announce = self.state_dir / "coordinator.json"
        announce.unlink(missing_ok=True)  # a stale file from a killed run must not be read
        cmd = [sys.executable, "-m", "coordinator", "--config", str(self.config), "--port", "0"]
        cmd += ["--state-dir", str(self.state_dir), *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"coordinator exited with {self.process.returncode}:\n{self.log()}"
                )
            if announce.exists():
                info = json.loads(announce.read_text())
                if info.get("pid") == self.process.pid:
                    self.url, self.run_id = info["url"], info["run_id"]
                    return self
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"coordinator did not listen within {START_TIMEOUT_S} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def terminate(self) -> int:
        """SIGTERM and wait for the exit code (SIGKILL if it does not stop in time)."""
        proc = self.process
        if proc is None:
            raise RuntimeError("the coordinator is not started")
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> CoordinatorProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
