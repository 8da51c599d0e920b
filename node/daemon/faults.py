"""Deterministic fault injection for the chaos suite, keyed to rounds and phases, never to time.

A node reads ``SPARSELOCO_FAULTS`` once at start: a comma-separated list of ``action@round``.
Unset (the normal case) means no faults and no cost. Actions:

- ``crash:<point>@R``: ``os._exit(137)`` at that point of round R, the same as a ``kill -9``
  landing there: nothing is flushed, no leave is sent. Points, in round order:
  ``after_train`` (trained and compressed, nothing saved yet), ``mid_upload`` (pending payload
  and state saved, before the PUT), ``after_upload`` (PUT done, before submit),
  ``after_submit`` (submitted, before the manifest), ``mid_apply`` (aggregate applied in
  memory, before the new state is saved).
- ``slow:<seconds>@R``: sleep that long after training round R, before uploading (a straggler
  that misses the deadline).
- ``slower:<factor>@R``: from round R on, every round's training takes ``factor`` times as long:
  after training, the node sleeps ``factor - 1`` times the training's time before uploading (a
  machine that became that much slower; not with ``overlap``).
- ``slowsteps:<factor>@R``: from round R on, every inner step takes ``factor`` times as long:
  after each step the compute thread sleeps ``factor - 1`` times that step's time (a slower
  GPU: unlike ``slower``, a round's time budget cuts it short between two steps).

A fault fires at most once per process; the chaos runner restarts a crashed node without the
variable. Tests only: nothing in a real deployment sets it. In-process unit tests of the daemon
build ``Faults`` directly with another ``die`` (raising instead of exiting), which leaves the
state directory exactly as a ``kill -9`` at that point would.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.errors import ConfigError

log = logging.getLogger("sparseloco.faults")

ENV = "SPARSELOCO_FAULTS"
CRASH_POINTS = ("after_train", "mid_upload", "after_upload", "after_submit", "mid_apply")
_ENTRY = re.compile(
    r"^(crash:(?P<point>[a-z_]+)|slow:(?P<secs>[0-9.]+)|slower:(?P<factor>[0-9.]+)"
    r"|slowsteps:(?P<steps>[0-9.]+))@(?P<round>\d+)$"
)


def kill9() -> None:
    """End the process at once, as ``kill -9`` would: nothing flushed, no cleanup run."""
    logging.shutdown()
    os._exit(137)


@dataclass
class Faults:
    crash: dict[int, str] = field(default_factory=dict)
    slow: dict[int, float] = field(default_factory=dict)
    #: (factor, first round) of ``slower``; None: full speed.
    slower: tuple[float, int] | None = None
    #: (factor, first round) of ``slowsteps``; None: full speed.
    slowsteps: tuple[float, int] | None = None
    #: What a crash point does when it fires.
    die: Callable[[], None] = kill9

    @classmethod
    def parse(cls, text: str | None) -> Faults:
        faults = cls()
        for raw in (text or "").split(","):
            entry = raw.strip()
            if not entry:
                continue
            m = _ENTRY.match(entry)
            if m is None or (m["point"] and m["point"] not in CRASH_POINTS):
                raise ConfigError(
                    f"{ENV}: bad entry {entry!r}; use crash:<{'|'.join(CRASH_POINTS)}>@R,"
                    " slow:<seconds>@R, slower:<factor>@R or slowsteps:<factor>@R"
                )
            r = int(m["round"])
            if m["point"]:
                faults.crash[r] = m["point"]
            elif m["secs"]:
                faults.slow[r] = float(m["secs"])
            else:
                factor = float(m["factor"] or m["steps"])
                if factor < 1:
                    raise ConfigError(f"{ENV}: {entry!r}: the factor must be at least 1")
                if m["factor"]:
                    faults.slower = (factor, r)
                else:
                    faults.slowsteps = (factor, r)
        return faults

    @classmethod
    def from_env(cls) -> Faults:
        return cls.parse(os.environ.get(ENV))

    def crash_point(self, round_: int, point: str) -> None:
        """Die like ``kill -9`` if a crash was asked for here."""
        if self.crash.get(round_) == point:
            del self.crash[round_]
            log.warning("event=fault_crash round=%d point=%s", round_, point)
            self.die()

    def slow_for(self, round_: int) -> float:
        return self.slow.pop(round_, 0.0)

    def step_pause(self, round_: int) -> Callable[[float], None] | None:
        """(``slowsteps``) What the compute thread does after each inner step of ``round_``
        that took ``step_s``: sleep ``factor - 1`` times as long; None at full speed."""
        if self.slowsteps is None or round_ < self.slowsteps[1]:
            return None
        extra = self.slowsteps[0] - 1.0
        return lambda step_s: time.sleep(extra * step_s)

    def slower_for(self, round_: int, trained_s: float) -> float:
        """Seconds to add after a training of ``trained_s`` in ``round_`` (``slower``)."""
        if self.slower is None or round_ < self.slower[1]:
            return 0.0
        return (self.slower[0] - 1.0) * trained_s
