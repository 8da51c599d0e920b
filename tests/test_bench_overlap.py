"""``sparseloco bench overlap``'s arithmetic on ``up`` summaries (the runs themselves are real
processes; ``test_network_run.py`` covers ``up --overlap`` end to end)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from node.cli import main, parse
from node.cluster.up import UpConfig
from node.research.bench import round_bench
from node.research.bench import utilisation as overlap_bench
from node.research.bench.utilisation import link_rate, markdown, schedules, utilisation


def summary(durations: list[float], train: dict[str, list[float]], moved: int) -> dict:
    """An ``up`` summary: per round its duration, every node's training seconds, bytes."""
    rounds = []
    for r, duration in enumerate(durations):
        timings = {node: {"train": seconds[r]} for node, seconds in train.items()}
        rounds.append(
            {
                "round": r,
                "duration_s": duration,
                "timings": timings,
                "bytes_up": moved * len(train) // 4,
                "bytes_down": moved * len(train) * 3 // 4,
            }
        )
    return {"rounds": rounds}


def test_utilisation_is_training_over_the_steady_rounds_wall_time() -> None:
    # Round 0 (slow start) and the last round are left out: 2 steady rounds of 10 s.
    result = summary([30.0, 10.0, 10.0, 3.0], {"a": [1, 8, 6, 1], "b": [1, 4, 4, 1]}, 4000)
    u = utilisation(result)
    assert u["wall_s"] == 20.0 and u["rounds"] == 2
    assert u["per_node"] == {"a": 0.7, "b": 0.4}
    assert u["utilisation"] == pytest.approx(0.55)
    assert u["slowest"] == pytest.approx(0.7)  # a trained longest in both rounds
    assert u["round_s"] == 10.0 and u["train_s"] == pytest.approx(5.5)


def test_the_cap_makes_transfers_take_the_chosen_share_of_training() -> None:
    result = summary([9.0, 9.0, 9.0, 9.0], {"a": [2, 2, 2, 2], "b": [2, 2, 2, 2]}, 4000)
    # 4000 bytes per node and round, 2 s of training: 2000 B/s makes them take 2 s.
    assert link_rate(result, 1.0) == 2000.0
    assert link_rate(result, 0.5) == 4000.0


def test_too_few_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        utilisation(summary([5.0, 5.0], {"a": [1, 1]}, 10))


def test_the_table_names_every_schedule() -> None:
    u = utilisation(summary([9, 9, 9, 9], {"a": [3, 3, 3, 3]}, 10))
    names = ("uncapped", "plain", "merge", "merge:10", "eager")
    text = markdown(
        {
            "rate_bytes_s": 1000.0,
            "link_share": 1.0,
            "runs": dict.fromkeys(names, u),
            "final_eval_loss": {"plain": 2.5, "merge": 2.25},
        }
    )
    assert "8.0 kbit/s" in text
    rows = [line.split("|") for line in text.splitlines()[4:]]
    assert [row[1].strip() for row in rows] == list(names)
    assert [row[6].strip() for row in rows] == ["-", "2.5000", "2.2500", "-", "-"]


def test_schedules_are_read_with_their_merge_step() -> None:
    assert schedules("merge, merge:10,eager") == [("merge", None), ("merge", 10), ("eager", None)]
    for bad in ("", "merge:0", "merge:x", "eager:3", "sideways"):
        with pytest.raises(ValueError):
            schedules(bad)


def test_the_command_takes_its_documented_flags() -> None:
    args = parse(["bench", "overlap", "--nodes", "3", "--preset", "small", "--link-share", "1"])
    assert (args.nodes, args.preset, args.link_share, args.variant) == (3, "small", 1.0, "merge")


def test_both_benches_start_their_runs_from_the_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--nodes``, ``--rounds``, ``--preset`` and ``--dir`` reach every ``up`` run each bench
    starts (``up`` faked: no processes), and its report."""
    started: list[UpConfig] = []

    def fake_up(cfg: UpConfig) -> dict[str, Any]:
        started.append(cfg)
        result = summary([9.0] * cfg.rounds, {"a": [3.0] * cfg.rounds}, 4000)
        return {**result, "final_eval_loss": 2.5, "fingerprints_agree": True}

    monkeypatch.setattr(round_bench, "up", fake_up)
    monkeypatch.setattr(overlap_bench, "up", fake_up)
    flags = ["--nodes", "2", "--rounds", "4", "--preset", "small", "--dir", str(tmp_path)]
    out = tmp_path / "out.json"
    assert main(["bench", "round", *flags, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["nodes"] == 2
    assert main(["bench", "overlap", *flags, "--variant", "eager", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["schedules"] == ["eager"]
    assert [cfg.run_dir for cfg in started] == [
        tmp_path,
        tmp_path / "uncapped",
        tmp_path / "plain",
        tmp_path / "eager",
    ]
    assert {(cfg.nodes, cfg.rounds, cfg.preset) for cfg in started} == {(2, 4, "small")}
    assert [cfg.round_timeout_s for cfg in started] == [120.0, 600.0, 600.0, 600.0]
