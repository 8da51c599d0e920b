"""``sparseloco bench sweep`` runs a 2-point grid in seconds and writes what it promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.cli import main


def test_bench_sweep_writes_every_point_and_the_best_k(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["bench", "sweep", "--model", "tiny", "--workers", "2", "--batch-size", "2"]
    argv += ["--steps", "2", "--hs", "1,2", "--topks", "8", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert [(p["H"], p["topk"], p["rounds"]) for p in doc["points"]] == [(1, 8, 2), (2, 8, 1)]
    assert all(p["final_eval_loss"] > 0 for p in doc["points"])
    assert doc["best_topk"] == {"1": 8, "2": 8}
    assert doc["tokens_per_worker"] == 2 * 2 * 64
    table = (out / "summary.md").read_text().splitlines()
    assert table[0] == "| H | rounds | k = 8 |" and len(table) == 4
    assert {p.name for p in out.glob("sparseloco-*.json")} == {
        "sparseloco-H1-k8.json",
        "sparseloco-H2-k8.json",
    }


def test_bench_sweep_refuses_an_h_that_does_not_divide_the_steps(tmp_path: Path) -> None:
    argv = ["bench", "sweep", "--model", "tiny", "--steps", "10", "--hs", "3"]
    with pytest.raises(SystemExit, match="must divide --steps"):
        main([*argv, "--out", str(tmp_path)])
