"""The runs of ``sparseloco up`` a benchmark starts: nodes, rounds, preset, where their folders go.

``bench round`` and ``bench overlap`` time real local runs and take the same four flags for them;
``node.research.bench.cli`` gathers those into one ``UpRuns`` value, and every run such a bench
starts is ``UpRuns.config`` with what that run changes (a timeout, caps, a schedule).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.cluster.up import UpConfig


@dataclass(frozen=True)
class UpRuns:
    nodes: int
    rounds: int
    preset: str
    #: The run folder, or with named runs the folder that holds one per run; None: ``up``'s
    #: default (a fresh folder under ``runs/``).
    run_dir: str | None = None

    def described(self) -> dict[str, Any]:
        """What a bench's report says of its runs: nodes, rounds, preset."""
        return {"nodes": self.nodes, "rounds": self.rounds, "preset": self.preset}

    def config(self, name: str | None = None, **changes: Any) -> UpConfig:
        """One run's ``UpConfig``: in its own folder ``run_dir/name`` when named; ``changes``
        are further ``UpConfig`` fields (validated there)."""
        folder = Path(self.run_dir) if self.run_dir else None
        if folder is not None and name is not None:
            folder = folder / name
        return UpConfig(
            nodes=self.nodes, rounds=self.rounds, preset=self.preset, run_dir=folder, **changes
        )
