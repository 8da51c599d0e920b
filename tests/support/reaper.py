"""No process outlives the test session: SIGTERM tears down like Ctrl-C, and a last sweep.

Tests start real processes: the session's SeaweedFS, coordinators, nodes, ``sparseloco up`` with
its own children. Their owners stop them in fixture finalizers, ``with`` blocks and ``finally``
clauses, but only if those run. Two things make sure they do, and a third catches what is left:

1. **SIGTERM becomes KeyboardInterrupt**, as SIGINT already is. Python's default for SIGTERM is
   to die on the spot, running no finalizer; raised as ``KeyboardInterrupt`` it unwinds the test
   and pytest then runs every fixture's teardown (``pytest_sessionfinish``), the session's store
   included. A second SIGTERM or SIGINT while that teardown runs does not interrupt it (an
   interrupted finalizer is how processes leak); it kills the session's processes at once
   instead, so the teardown's waits end quickly.
2. **Every descendant is marked.** At configure time the session appends its token to
   ``SPARSELOCO_TEST_SESSION`` in its own environment; every process a test starts inherits it,
   and so do that process's children, even once orphaned (``subprocess.run`` interrupted kills
   ``sparseloco up`` but not the store and nodes it started).
3. **The sweep.** When the session ends, however it ends (``pytest_unconfigure``, and ``atexit``
   should that not run), every process whose environment holds the token gets SIGTERM, then
   SIGKILL after ``GRACE_S``; a process leading its own group is signalled as a group, so helpers
   it forks meanwhile go with it. Survivors are listed on stderr: after a clean run they are a
   test's leak.

The sweep reads ``/proc/<pid>/environ`` (Linux, own processes only); elsewhere it finds nothing
and steps 1 and the owners' own teardown remain. A nested pytest (``test_test_session.py``)
appends its own token, so the outer session's sweep still finds the inner one's processes.
"""

from __future__ import annotations

import atexit
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

#: The environment variable that marks a process as started by a test session.
MARK = "SPARSELOCO_TEST_SESSION"
#: Seconds survivors get to exit after SIGTERM before SIGKILL.
GRACE_S = 5.0
#: Signals that end the session in order.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
#: Helpers of a Python interpreter that end with it (at EOF of their pipe), not leaks.
OWN_HELPERS = (b"from multiprocessing.resource_tracker import", b"from multiprocessing.forkserver")


def session_pids(token: str, proc: Path = Path("/proc")) -> list[int]:
    """Pids of live processes (this one excluded) whose environment carries ``token``."""
    want = token.encode()
    prefix = MARK.encode() + b"="
    own = os.getpid()
    found = []
    try:
        entries = list(os.scandir(proc))
    except OSError:
        return []  # no /proc: nothing to sweep here
    for entry in entries:
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            environ = (proc / entry.name / "environ").read_bytes()
        except OSError:
            continue  # gone, a zombie, or not ours
        for var in environ.split(b"\0"):
            if var.startswith(prefix) and want in var[len(prefix) :].split():
                if not _own_helper(proc / entry.name):
                    found.append(int(entry.name))
                break
    return found


def _own_helper(path: Path) -> bool:
    try:
        cmdline = (path / "cmdline").read_bytes()
    except OSError:
        return False
    return any(helper in cmdline for helper in OWN_HELPERS)


def _signal_all(pids: list[int], sig: signal.Signals) -> None:
    own_group = os.getpgrp()
    for pid in pids:
        try:
            group = os.getpgid(pid)
            # A group led by one of ours holds only its descendants: signal them all at once.
            if group == pid and group != own_group:
                os.killpg(group, sig)
            else:
                os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # exited meanwhile


def sweep(token: str, grace_s: float = GRACE_S) -> list[str]:
    """End every process of the session (SIGTERM, then SIGKILL after ``grace_s``).

    Returns a line (pid and command) per process found alive at the start."""
    pids = session_pids(token)
    if not pids:
        return []
    found = [f"{pid} {_cmdline(pid)}" for pid in pids]
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.1)
        pids = session_pids(token)
    for _ in range(5):  # a process may fork while we kill: look again until none is left
        if not pids:
            break
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.1)
        pids = session_pids(token)
    return found


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


class Reaper:
    """The session's token, its signal handlers, and the sweep at the end."""

    def __init__(self) -> None:
        self.token = f"{os.getpid()}.{secrets.token_hex(4)}"
        self.stopping = False
        self.swept = False
        self._previous: dict[signal.Signals, object] = {}

    def install(self) -> None:
        outer = os.environ.get(MARK, "")
        os.environ[MARK] = f"{outer} {self.token}".strip()
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        atexit.register(self.finish)

    def rearm(self) -> None:
        """Install the handlers again where a test replaced them: an event loop's
        ``add_signal_handler`` leaves SIG_DFL behind when the loop closes."""
        if self.swept:
            return
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) != self._on_signal:
                signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # pytest prints the exception (``KeyboardInterrupt: SIGTERM``); any other output here
        # would land in the test's captured output and be lost.
        if not self.stopping:
            self.stopping = True
            raise KeyboardInterrupt(signal.Signals(signum).name)
        sweep(self.token, grace_s=0.0)

    def finish(self) -> None:
        """Restore the handlers and sweep (once)."""
        if self.swept:
            return
        self.swept = True
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        left = sweep(self.token)
        if left:
            sys.stderr.write(
                f"reaper: {len(left)} processes outlived their tests, ended now:\n  "
                + "\n  ".join(left)
                + "\n"
            )


_KEY = pytest.StashKey[Reaper]()


def pytest_configure(config: pytest.Config) -> None:
    reaper = Reaper()
    reaper.install()
    config.stash[_KEY] = reaper


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    reaper = item.config.stash[_KEY]
    reaper.rearm()
    try:
        return (yield)
    finally:
        reaper.rearm()


def pytest_unconfigure(config: pytest.Config) -> None:
    reaper = config.stash.get(_KEY, None)
    if reaper is not None:
        reaper.finish()


def live(pids: list[int]) -> Iterator[int]:
    """Those of ``pids`` that still run (a zombie, killed but not yet reaped, does not)."""
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            yield pid
