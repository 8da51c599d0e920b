"""``sparseloco node --ranks N``: one node of N processes on this host, ending as a node ends.

It starts what ``torchrun --standalone --nproc-per-node N -m node node ...`` starts: N copies of
the same command, each told its place the way torchrun tells it (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, and ``MASTER_ADDR``/``MASTER_PORT`` of the rendezvous
rank 0 hosts on a free loopback port); ``node.daemon.ranks`` takes it from there. What differs
is the exit status, which is what a supervisor (systemd, a container runtime, a script) reads:

- torchrun, a launcher of jobs, exits 1 with its ``ChildFailedError`` report when any process
  exits non-zero (a revoked token's 2 included), and 1 when it is signalled itself, however
  cleanly the node then stopped;
- this launcher exits as a one-process node would: rank 0's status when that is not 0 (2:
  refused for good, said in rank 0's one line), else 1 if another process failed, else 0, a
  stop by SIGTERM or Ctrl-C included. It prints a line of its own only for a process killed by
  a signal, which no process could report.

SIGTERM, SIGINT and SIGHUP are passed on to every process (each takes a repeat as the same stop
request: a terminal's Ctrl-C reaches them twice). A process that ends ends the node: the others
get ``GRACE_S`` to follow (a collective with a dead peer fails at once), then SIGTERM, then
SIGKILL after as long again. The processes get SIGTERM if the launcher itself is killed
(``PR_SET_PDEATHSIG``, Linux).

The launcher never imports torch: it is a small supervisor beside N heavy processes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType

from node.cluster.seaweed import free_ports

#: How long the other processes have to end once one has ended, before SIGTERM, and again
#: before SIGKILL.
GRACE_S = 30.0
#: How often the processes are looked at.
POLL_S = 0.2
#: Signals handed on to the node's processes.
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: prctl's option number for "signal me when my parent dies" (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def started_world(env: Mapping[str, str] = os.environ) -> int:
    """How many processes torchrun (or this launcher) started for this node; 0 for neither."""
    if "TORCHELASTIC_RUN_ID" not in env and "WORLD_SIZE" not in env:
        return 0
    try:
        return int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def rank_env(
    rank: int, world: int, port: int, base: Mapping[str, str], threads: int | None = None
) -> dict[str, str]:
    """Process ``rank``'s environment: ``base`` and its place in the node, as torchrun gives it.

    The thread pools of torch and the codec are sized before ``--threads`` is read: to
    ``threads`` when given (0 is the settings' "not given"), else (unless ``base`` sizes them)
    to the host's cores over ``world`` (torchrun gives 1)."""
    env = dict(base)
    env.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    if threads:  # 0 or None: the node's default (``--threads`` not given)
        env.update(OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads))
    share = str(max(1, (os.cpu_count() or 1) // world))
    env.setdefault("OMP_NUM_THREADS", share)
    env.setdefault("NUMBA_NUM_THREADS", share)
    return env


def exit_status(codes: Sequence[int], passed_on: bool, forced: set[int]) -> tuple[int, str | None]:
    """The node's exit status from its processes' (rank order; negative: killed by that
    signal), and the one line to print (None: the processes said what there was to say).

    ``passed_on``: the launcher handed a stop signal on, so a process that died of that very
    signal (before its handlers were in place) stopped as asked. ``forced``: the ranks the
    launcher killed itself (it said so when it did)."""
    failed = [
        rank
        for rank, code in enumerate(codes)
        if code > 0 or (code < 0 and not (passed_on and -code in PASSED_ON))
    ]  # fmt: skip
    killed = [(rank, -codes[rank]) for rank in failed if codes[rank] < 0 and rank not in forced]
    line = None
    if killed:
        rank, sig = killed[0]
        line = (
            f"sparseloco: error: process {rank} of the node's {len(codes)} was killed by"
            f" {signal.Signals(sig).name}; the others ended with it. The same command with the"
            " same --state-dir resumes the node"
        )
    if codes[0] > 0:
        return codes[0], line
    if failed:
        return 1, line
    return 0, line  # finished, or stopped as asked


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the processes outlive a killed launcher
        pass


class Launcher:
    """``world`` processes of ``command`` as one node (``run``: its exit status)."""

    def __init__(
        self,
        command: Sequence[str],
        world: int,
        *,
        threads: int | None = None,
        env: Mapping[str, str] | None = None,
    ):
        if world < 1:
            raise ValueError(f"a node has at least one process, not {world}")
        self.command = list(command)
        self.world, self.threads = world, threads
        self.env = dict(os.environ if env is None else env)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.signalled: list[int] = []
        #: Ranks that did not end within twice the grace of the first end, killed here.
        self.forced: set[int] = set()

    def run(self) -> int:
        handlers = {sig: signal.signal(sig, self._pass_on) for sig in PASSED_ON}
        try:
            (port,) = free_ports(1)
            for rank in range(self.world):
                env = rank_env(rank, self.world, port, self.env, self.threads)
                self.procs.append(
                    subprocess.Popen(self.command, env=env, preexec_fn=_die_with_parent)
                )
            for sig in self.signalled:  # one that came while the processes were starting
                self._send(sig)
            codes = self._wait()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        code, line = exit_status(codes, bool(self.signalled), self.forced)
        if line:
            print(line, file=sys.stderr)
        return code

    def _pass_on(self, signum: int, frame: FrameType | None) -> None:
        self.signalled.append(signum)
        self._send(signum)

    def _send(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(sig)

    def _force(self, codes: list[int | None]) -> None:
        late = [rank for rank, code in enumerate(codes) if code is None]
        for rank in late:
            self.forced.add(rank)
            self.procs[rank].kill()
        names = ", ".join(map(str, late))
        print(
            f"sparseloco: process {names} of the node's {self.world} did not end within"
            f" {2 * GRACE_S:.0f} s of the first that ended, and was killed",
            file=sys.stderr,
        )

    def _wait(self) -> list[int]:
        """Every process's exit status, ending the others once one has ended."""
        first_end: float | None = None
        termed = False
        while True:
            codes = [proc.poll() for proc in self.procs]
            if all(code is not None for code in codes):
                return [int(code) for code in codes if code is not None]
            if first_end is None and any(code is not None for code in codes):
                first_end = time.monotonic()
            if first_end is not None:
                waited = time.monotonic() - first_end
                if waited > 2 * GRACE_S:
                    self._force(codes)
                elif waited > GRACE_S and not termed:
                    termed = True
                    self._send(signal.SIGTERM)
            time.sleep(POLL_S)
