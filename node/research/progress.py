"""Progress display for long jobs: a rich progress bar on a terminal, log lines otherwise.

Simulations and benchmarks run for minutes; a person watching wants to see the round and the
current loss, while CI logs want one line per round rather than redraw codes.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger("sparseloco.progress")


@contextmanager
def round_progress(title: str, total_rounds: int) -> Iterator[Callable[[int, float], None]]:
    """Yield a callback ``(round, eval_loss)`` that advances a bar (or logs a line)."""
    if not sys.stderr.isatty():

        def log_line(round_: int, loss: float) -> None:
            # ``round_`` counts rounds done (0: before the first), so it reads as a count.
            log.info("%s done=%d/%d eval_loss=%.4f", title, round_, total_rounds, loss)

        yield log_line
        return
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("eval loss {task.fields[loss]}"),
        TimeElapsedColumn(),
        transient=False,
    ) as bar:
        task = bar.add_task(title, total=total_rounds, loss="-")

        def advance(round_: int, loss: float) -> None:
            bar.update(task, completed=round_, loss=f"{loss:.4f}")

        yield advance
