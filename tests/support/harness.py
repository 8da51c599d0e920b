"""Helpers for integration tests that run a real coordinator process.

``write_coordinator_config`` writes the TOML a coordinator reads; ``CoordinatorProcess`` starts
``python -m coordinator`` on a free port with ``node.cluster.launch.start_coordinator`` (so the
tests and ``sparseloco up`` share one launcher and one supervisor), keeps the URL and run id it
announces, and always kills it when the ``with`` block ends. The process log goes to
``{state_dir}/coordinator.log`` so a failing test can show it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType

from node.cluster.launch import coordinator_toml, start_coordinator
from node.cluster.process import Process
from node.cluster.seaweed import StoreEndpoint
from protocol.runconfig import RunConfig

REPO_ROOT = Path(__file__).resolve().parents[2]


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
    """Write a coordinator TOML config at ``path`` (``node.cluster.launch.coordinator_toml``)."""
    out = Path(path)
    text = coordinator_toml(
        run, endpoint, dict(tokens), Path(state_dir), prefix=prefix, server=server
    )
    out.write_text(text + "\n")
    return out


class CoordinatorProcess:
    """``python -m coordinator --config CONFIG --port 0 --state-dir STATE`` for one test."""

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
        self.process: Process | None = None
        self.url = ""
        self.run_id = ""

    def start(self) -> CoordinatorProcess:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        args = ["--state-dir", str(self.state_dir), *self.extra_args]
        self.process, self.url = start_coordinator(
            self.config, self.state_dir, self.log_path, extra_args=args
        )
        announced = json.loads((self.state_dir / "coordinator.json").read_text())
        self.run_id = announced["run_id"]
        return self

    def log(self) -> str:
        return self.process.output() if self.process else ""

    def terminate(self) -> int:
        """SIGTERM and wait for the exit code (SIGKILL if it does not stop in time)."""
        if self.process is None:
            raise RuntimeError("the coordinator is not started")
        return self.process.stop()

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()

    def __enter__(self) -> CoordinatorProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()
