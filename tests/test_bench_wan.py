"""``sparseloco bench wan``: its arithmetic on ``up`` summaries, its flags, and one short real
run through the WAN lab (root only; no timing is asserted, the machine's load decides it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from node.cli import parse
from node.research.bench.wan import again, compare, markdown, measured_inputs, profiles
from node.research.bench.wire import Link


def summary(durations: list[float], train: dict[str, list[float]]) -> dict[str, Any]:
    """An ``up`` summary: per round its duration, every node's timings, 10 kB per payload."""
    rounds = []
    for r, duration in enumerate(durations):
        timings = {
            node: {"train": seconds[r], "encode": 0.1, "decode": 0.05, "save": 0.05, "upload": 0.2}
            for node, seconds in train.items()
        }
        rounds.append(
            {
                "round": r,
                "duration_s": duration,
                "gather": sorted(train),
                "timings": timings,
                "bytes_up": 10_000 * len(train),
                "bytes_down": 10_000 * len(train) ** 2,
            }
        )
    return {"rounds": rounds}


def test_the_inputs_are_the_slowest_node_over_rounds_two_to_the_one_before_last() -> None:
    # Rounds 0, 1 and 5 are left out: rounds 2-4 are steady.
    result = summary([9, 9, 3, 3, 3, 1], {"a": [5, 5, 1, 2, 3, 5], "b": [5, 5, 2, 2, 2, 5]})
    inputs = measured_inputs(result)
    assert inputs["train_s"] == pytest.approx((2 + 2 + 3) / 3)
    assert inputs["work_s"] == pytest.approx(0.2) and inputs["free_s"] == pytest.approx(0.05)
    assert inputs["payload_bytes"] == 10_000 and inputs["peers"] == 2
    assert inputs["upload_s"] == pytest.approx(0.2)
    # Overlapped, a slow round is caught up in the next: the slowest node's mean, 2 s here.
    assert measured_inputs(result, overlapped=True)["train_s"] == pytest.approx(2.0)


def test_on_a_link_without_delay_the_projection_is_training_work_and_bytes() -> None:
    result = summary([9, 9, 3, 3, 3, 1], {"a": [5, 5, 2, 2, 2, 5], "b": [5, 5, 2, 2, 2, 5]})
    flat = Link(name="flat", up_mbit=8, down_mbit=8)  # 1 MB/s: 10 kB up, 20 kB down
    row = compare(result, flat, overlapped=False)
    assert row["projected_round_s"] == pytest.approx(2 + 0.2 + 0.01 + 0.02)
    assert row["measured_round_s"] == pytest.approx(3.0)
    assert row["ratio"] == pytest.approx(3.0 / 2.23)
    assert row["measured_util"] == pytest.approx(2 / 3)
    overlapped = compare(result, flat, overlapped=True)
    assert overlapped["projected_round_s"] == pytest.approx(2 + 0.15)  # decode runs beside
    delayed = compare(result, flat.model_copy(update={"rtt_ms": 100.0}), overlapped=False)
    assert delayed["projected_round_s"] > row["projected_round_s"] + 0.5  # 6 round trips
    table = markdown(
        [
            row
            | {"profile": "flat", "model": "m", "schedule": "plain"}
            | {"load": [1.0, 1.0], "resets": 0}
        ]
    )
    assert "| flat | m | plain | 3.00 | 2.23 | 1.35 |" in table


def test_a_saved_report_is_compared_again_without_running(tmp_path: Path) -> None:
    result = summary([9, 9, 3, 3, 3, 1], {"a": [5, 5, 2, 2, 2, 5], "b": [5, 5, 2, 2, 2, 5]})
    rows = [
        {"profile": "home", "model": "m", "schedule": "plain", "load": [1.0, 1.0], "resets": 0}
        | {"rounds": result["rounds"], "ratio": 99.0},
        {"profile": "far", "model": "m", "schedule": "overlap", "error": "node-0 exited"},
    ]
    saved = tmp_path / "wan.json"
    saved.write_text(json.dumps({"rows": rows}))
    again_rows = again(str(saved), str(tmp_path / "again.json"))["rows"]
    assert again_rows[0]["ratio"] < 2 and again_rows[0]["wire"]["requests_s"] > 0
    assert again_rows[1]["error"] == "node-0 exited"
    assert json.loads((tmp_path / "again.json").read_text())["rows"][0]["ratio"] < 2


def test_too_few_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="steady"):
        measured_inputs(summary([5, 5, 5], {"a": [1, 1, 1]}))


def test_the_profiles_are_the_labs_and_lan() -> None:
    assert list(profiles(["lan", "home", "flaky"])) == ["lan", "home", "flaky"]
    assert profiles(["lan"])["lan"].rtt_ms == 0
    assert profiles(["flaky@5"])["flaky@5"].reset_every_s == 5.0
    with pytest.raises(ValueError, match="unknown profile"):
        profiles(["moon"])


def test_the_command_takes_its_documented_flags() -> None:
    args = parse(["bench", "wan", "--profiles", "home,far", "--models", "small", "--nodes", "2"])
    assert (args.profiles, args.models, args.nodes, args.rounds) == ("home,far", "small", 2, 8)
    assert args.schedules == "plain,overlap"


def test_one_short_run_through_the_lab(tmp_path: Path) -> None:
    """Two nodes on ``home``, the small model, 4 rounds, plain: the run finishes, agrees, and
    the row has every column. About 30-60 s on 2 cores."""
    from node.research.wan.lab import WanLab

    reason = WanLab.available()
    if reason is not None:
        pytest.skip(f"the WAN lab cannot run here: {reason}")
    from node.research.bench.wan import run

    report = run(
        str(tmp_path / "wan.json"),
        profile_names=["home"],
        models=["small"],
        schedules=["plain"],
        nodes=2,
        rounds=4,
        run_dir=str(tmp_path / "runs"),
    )
    (row,) = report["rows"]
    assert row["fingerprints_agree"]
    assert row["measured_round_s"] > 0 and row["projected_round_s"] > 0
    assert row["wire"]["requests_s"] > 0  # home's 40 ms round trips are in the projection
    assert (tmp_path / "wan.json").exists()
