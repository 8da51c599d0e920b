"""The one supervisor of child processes in a local run: the store, the coordinator, the nodes.

A ``Process`` starts a command with its output appended to a log file, and ends it in one of two
ways: ``stop()`` asks first (SIGTERM), waits, and only then kills (SIGKILL); ``kill()`` is
``kill -9`` straight away, nothing flushed, as a crash would be. Either way the child is reaped,
so no zombie outlives its owner. With ``own_group`` the child leads a new process group and every
signal goes to the whole group: ``weed mini`` forks helpers that must not outlive it, and a
Ctrl-C in the terminal then reaches only the launcher, which stops its children in order.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Seconds to wait for a clean exit after SIGTERM before killing.
STOP_TIMEOUT_S = 30.0


class Process:
    """A started child process, its log file and the signals that end it."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        own_group: bool = False,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self.own_group = own_group
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:  # the child keeps its own descriptor
            self.popen = subprocess.Popen(
                list(args),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=own_group,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once reaped (negative: killed by that signal), else ``None``."""
        return self.popen.returncode

    def poll(self) -> int | None:
        """The exit code if the child has exited, else ``None``."""
        return self.popen.poll()

    def send_signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the child (to its whole group with ``own_group``) if it still runs."""
        if self.popen.poll() is not None:
            return
        try:
            if self.own_group:
                os.killpg(self.popen.pid, sig)
            else:
                self.popen.send_signal(sig)
        except ProcessLookupError:
            pass  # it exited between the poll and the signal

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL; return the exit code."""
        if self.popen.poll() is None:
            self.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL (``kill -9``: nothing flushed) and reap; return the exit code."""
        self.send_signal(signal.SIGKILL)
        return self.popen.wait()

    def output(self) -> str:
        """Everything the child has written to its log so far ("" if there is no log)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 15) -> str:
        """The last ``lines`` lines of the log, for error messages."""
        return "\n".join(self.output().splitlines()[-lines:])
