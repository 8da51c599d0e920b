"""Slow whole processes from the outside: SIGSTOP/SIGCONT in a duty cycle.

A node under ``Throttle(factor=4)`` runs for a quarter of every ``PERIOD_S`` and is stopped for
the rest, so everything it does (training, compression, transfers, heartbeats) takes about four
times as long, as on a machine four times slower. Nothing in the product knows about it. Every
process is continued when the throttle stops, even if the test fails.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable

from node.cluster.process import Process

#: One stop-and-run cycle, seconds: short against a heartbeat interval, long against a tick of
#: the scheduler.
PERIOD_S = 0.2


class Throttle:
    """Runs ``processes`` for ``1 / factor`` of the time until ``stop``."""

    def __init__(self, processes: Iterable[Process], factor: float) -> None:
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        self.processes = list(processes)
        self.run_s = PERIOD_S / factor
        self.stop_s = PERIOD_S - self.run_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._cycle, name="throttle", daemon=True)

    def start(self) -> Throttle:
        self._thread.start()
        return self

    def _signal(self, sig: signal.Signals) -> None:
        for proc in self.processes:
            proc.send_signal(sig)

    def _cycle(self) -> None:
        try:
            while not self._done.is_set():
                self._signal(signal.SIGSTOP)
                self._done.wait(self.stop_s)
                self._signal(signal.SIGCONT)
                self._done.wait(self.run_s)
        finally:
            self._signal(signal.SIGCONT)

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)
        self._signal(signal.SIGCONT)

    def __enter__(self) -> Throttle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
