"""Run presets: the named run shapes every command shares, in one table.

A preset fixes the shape of a run (the model preset, H inner steps per round, the batch per
step) and default counts (workers or nodes, rounds). ``sparseloco up --preset``,
``sparseloco simulate --preset`` and the benchmarks all read this table; explicit flags override
any value, and ``up`` has its own defaults for ``--nodes`` and ``--rounds``.

| preset | model | H | batch | workers | rounds | for |
|---|---|---:|---:|---:|---:|---|
| tiny | tiny (0.1 M) | 10 | 8 | 2 | 3 | seconds: ``sparseloco up``, tests, smoke checks |
| small | small (0.44 M) | 30 | 12 | 3 | 5 | a longer local run |
| bench | small (0.44 M) | 30 | 12 | 4 | 30 | the CPU quality benchmark (``bench quality``) |
| base | base (10.8 M) | 5 | 4 | 4 | 6 | ``bench round`` at a size where the payload path shows |
| llama | llama_tiny (0.1 M, LLaMA-style) | 10 | 8 | 2 | 3 | the LLaMA-style model in seconds |
| llama_bpe | llama_bpe4k (2.6 M, 4,096 ids) | 10 | 8 | 2 | 3 | data from ``--train-bpe 4096`` |
| llama_moe | llama_moe (11.3 M, 4.2 M active) | 10 | 8 | 2 | 3 | experts on the BPE data |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from protocol.errors import ConfigError


@dataclass(frozen=True)
class RunPreset:
    model: str
    inner_steps: int
    batch_size: int
    workers: int
    rounds: int

    def shape(self) -> dict[str, Any]:
        """The run's shape only (model, H, batch): what ``up`` takes from a preset."""
        return {"model": self.model, "inner_steps": self.inner_steps, "batch_size": self.batch_size}

    def values(self) -> dict[str, Any]:
        """Everything, for the simulator (``workers`` and ``rounds`` included)."""
        return asdict(self)


PRESETS: dict[str, RunPreset] = {
    "tiny": RunPreset(model="tiny", inner_steps=10, batch_size=8, workers=2, rounds=3),
    "small": RunPreset(model="small", inner_steps=30, batch_size=12, workers=3, rounds=5),
    "bench": RunPreset(model="small", inner_steps=30, batch_size=12, workers=4, rounds=30),
    "base": RunPreset(model="base", inner_steps=5, batch_size=4, workers=4, rounds=6),
    "llama": RunPreset(model="llama_tiny", inner_steps=10, batch_size=8, workers=2, rounds=3),
    "llama_bpe": RunPreset(model="llama_bpe4k", inner_steps=10, batch_size=8, workers=2, rounds=3),
    "llama_moe": RunPreset(model="llama_moe", inner_steps=10, batch_size=8, workers=2, rounds=3),
}


def get_run_preset(name: str) -> RunPreset:
    """The preset called ``name``; ``ConfigError`` listing the valid names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown --preset {name!r}; choose one of {sorted(PRESETS)}") from None
