"""What ``sparseloco up`` shows while it runs: a live table on a terminal, log lines otherwise.

Fed with the coordinator's ``StatusView`` a couple of times a second. The table has one row
per node (state, last training loss, newest held-out loss, bytes up and down, whether it was in
the last gather set); below it the round, the gather set and whether the fingerprints agreed.
Without a terminal (CI, a pipe) it writes one line per closed round instead: the gather set,
exclusions, the mean training loss, the held-out loss, the bytes all nodes sent and received in
that round, and whether the fingerprints agreed. The table fits 80 columns; while it is live,
this process's own log lines go to a file in the run folder (``logs/up.log``) instead of the
terminal, where they would run into it (the store, coordinator and nodes log to files there).

Rounds are numbered as everywhere else (the API, ``--json``, the coordinator's and the nodes'
logs): from 0. Progress is said as a count: ``round=2 done=3/5`` is round 2 closing, the third
of five.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from protocol.messages import RoundState
from protocol.status import RoundSummary, StatusView

log = logging.getLogger("sparseloco.up")

#: The table's columns that hold words (left-aligned); the rest are numbers.
_TEXT = ("node", "state", "gathered")


def _bytes(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def _agree(summary: RoundSummary) -> str:
    values = set(summary.fingerprints.values())
    if not values:
        return "-"
    return "agree" if len(values) == 1 else f"DIFFER ({len(values)} values)"


class UpView:
    """Context manager rendering the run's progress."""

    def __init__(self, rounds: int, nodes: int, log_path: Path | None = None) -> None:
        """``log_path``: where this process's log lines go while the live table is on."""
        self.rounds = rounds
        self.nodes = nodes
        self.log_path = log_path
        self.tty = sys.stderr.isatty()
        #: The handlers that wrote to the terminal, set aside while the table is live.
        self._parked: list[logging.Handler] = []
        self._file: logging.Handler | None = None
        self.console = Console(stderr=True)
        self.live: Live | None = None
        self.logged: set[int] = set()
        self.totals: dict[str, list[int]] = {}
        #: Each node's newest held-out loss: rounds off the evaluation schedule report none.
        self.eval_loss: dict[str, float] = {}

    def __enter__(self) -> UpView:
        if self.tty:
            self._divert_logs()
            self.live = Live(
                Text("starting the object store and the coordinator..."),
                console=self.console,
                refresh_per_second=4,
            )
            self.live.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.live is not None:
            self.live.__exit__(exc_type, exc, tb)
        self._restore_logs()

    def _divert_logs(self) -> None:
        """Send this process's log lines to ``log_path`` instead of the terminal, where they
        would run into the live table (the children write to their own files already)."""
        root = logging.getLogger()
        self._parked = [
            h
            for h in root.handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        ]
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._file = logging.FileHandler(self.log_path, encoding="utf-8")
            self._file.setFormatter(
                logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
            )
            root.addHandler(self._file)
        for handler in self._parked:
            root.removeHandler(handler)

    def _restore_logs(self) -> None:
        root = logging.getLogger()
        for handler in self._parked:
            root.addHandler(handler)
        self._parked = []
        if self._file is not None:
            root.removeHandler(self._file)
            self._file.close()
            self._file = None

    def update(self, status: StatusView) -> None:
        closed = [r for r in status.rounds if r.state == RoundState.CLOSED]
        self.totals = {}
        for summary in closed:
            for node, report in summary.reports.items():
                up, down = self.totals.setdefault(node, [0, 0])
                self.totals[node] = [up + report.bytes_up, down + report.bytes_down]
                if report.eval_loss is not None:
                    self.eval_loss[node] = report.eval_loss
        if self.live is not None:
            self.live.update(self._render(status, closed))
            return
        for summary in closed:
            if summary.round in self.logged or len(summary.reports) < len(summary.gather):
                continue
            self.logged.add(summary.round)
            reports = summary.reports.values()
            losses = [r.eval_loss for r in reports if r.eval_loss is not None]
            train = [r.train_loss for r in reports if r.train_loss is not None]
            log.info(
                "event=round_closed round=%d done=%d/%d gather=%s excluded=%s train_loss=%s"
                " eval_loss=%s bytes_up=%d bytes_down=%d fingerprints=%s duration_s=%.2f",
                summary.round,
                summary.round + 1,
                self.rounds,
                ",".join(summary.gather) or "-",
                summary.excluded or "-",
                f"{sum(train) / len(train):.4f}" if train else "-",
                f"{losses[0]:.4f}" if losses else "-",
                sum(r.bytes_up for r in reports),
                sum(r.bytes_down for r in reports),
                _agree(summary),
                summary.duration_s or 0.0,
            )

    def _render(self, status: StatusView, closed: list[RoundSummary]) -> Group:
        last = closed[-1] if closed else None
        # Fits 80 columns with the widest values (``node-31``, ``timed out``, ``1000.0 MB``):
        # no cell is ever wrapped or cut, and the lines below stay short whatever the gather.
        table = Table(
            title=f"run {status.run_id}",
            caption="train, eval: loss (nats); up, down: bytes so far",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
        )
        for col in ("node", "state", "train", "eval", "up", "down", "gathered"):
            table.add_column(col, no_wrap=True, justify="left" if col in _TEXT else "right")
        for member in status.members:
            report = last.reports.get(member.node_id) if last else None
            up, down = self.totals.get(member.node_id, [0, 0])
            eval_loss = self.eval_loss.get(member.node_id)
            table.add_row(
                member.node_id,
                member.state.value,
                f"{report.train_loss:.4f}" if report and report.train_loss else "-",
                f"{eval_loss:.4f}" if eval_loss is not None else "-",
                _bytes(up),
                _bytes(down),
                "yes" if last and member.node_id in last.gather else "-",
            )
        done = min(status.round, self.rounds)  # rounds before the one in progress are closed
        if status.state == RoundState.FINISHED:
            lines = [f"finished: {done} of {self.rounds} rounds done"]
        else:
            lines = [f"round {status.round} ({status.state.value}), {done} of {self.rounds} done"]
        if last is not None:
            lines.append(
                f"last gather: {len(last.gather)} of {len(status.members)} nodes,"
                f" fingerprints {_agree(last)}"
            )
        return Group(table, *(Text(line, overflow="fold") for line in lines))

    def summary(self, result: dict[str, Any]) -> None:
        rounds = result["rounds"]
        loss = result["final_eval_loss"]
        # Rounds off the evaluation schedule report no loss: the first one measured.
        first = next((r["eval_loss"] for r in rounds if r["eval_loss"] is not None), None)
        agree = "identical on all nodes" if result["fingerprints_agree"] else "DIFFERED"
        # Lines that fit 80 columns (the run folder's path is as long as it is).
        head = f"run {result['run_id']}: {len(rounds)} rounds"
        if loss is None or first is None:
            print(f"{head}; fingerprints {agree}")
            return
        took = result.get("command_seconds", result["wall_seconds"])
        print(f"{head} with {result['nodes']} nodes in {took:.1f} s")
        print(f"  eval loss {first:.4f} -> {loss:.4f}; fingerprints {agree}")
        print(f"  files in {result['run_dir']}")
