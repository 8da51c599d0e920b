"""Run a function on every rank of a node of N processes: the benchmarks' spawner
(``node.research.bench.spawn``) with the tests' safety net, results in ``tmp_path / "out"``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.research.bench.spawn import spawn as spawn_ranks

#: Safety net for one spawned node (a healthy one needs a small fraction).
WAIT_S = 300.0


def spawn(world: int, child: Callable[..., None], tmp_path: Path, *args: Any) -> list[int | None]:
    """Run ``child(group, tmp_path / "out", *args)`` on ``world`` ranks; their exit codes."""
    return spawn_ranks(world, child, tmp_path / "out", *args, wait_s=WAIT_S)
