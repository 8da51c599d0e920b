"""The two benchmarks of the node's own work, on made-up or tiny inputs (numbers not checked).

``round_bench.phase_table`` amortises evaluation over the rounds off the schedule; ``node_work``
runs a whole round of the node's own work on the tiny model and counts one fingerprint of θ.
"""

from __future__ import annotations

import pytest

import protocol.runconfig as runconfig
from node.compute.model import PRESETS, get_preset
from node.research.bench import node_work
from node.research.bench.round_bench import markdown, phase_table
from protocol.runconfig import RunConfig


def _entry(round_: int, eval_s: float | None) -> dict[str, object]:
    timings = {"train": 1.0, "encode": 0.1, "save": 0.05}
    if eval_s is not None:
        timings["eval"] = eval_s
    return {"round": round_, "duration_s": 1.5, "timings": {"n0": timings, "n1": dict(timings)}}


def test_evaluation_is_amortised_over_the_rounds_it_skips() -> None:
    result = {"rounds": [_entry(0, 9.0), _entry(1, None), _entry(2, None), _entry(3, 0.6)]}
    table = phase_table(result)  # round 0 left out: 2 of 3 rounds without evaluation
    assert table["eval"] == pytest.approx(0.2)
    assert table["train"] == 1.0 and table["round"] == 1.5
    text = markdown(table)
    assert "| own work (no network, no waits) vs training | 0.350 | 25.9 % |" in text


def test_the_node_work_bench_runs_a_round_and_hashes_theta_once(tmp_path) -> None:
    report = node_work.run(preset="tiny", ranks=(1, 2), rounds=1, peers=2, state_dir=str(tmp_path))
    one, two = report["nodes"]
    assert (one["ranks"], two["ranks"]) == (1, 2)
    for node in (one, two):
        assert node["fingerprints_of_theta"] == 1
        assert set(node["ns_per_param"]) == set(node_work.PARTS)
        assert all(mb > 0 for mb in node["peak_rss_above_idle_mb"])
    # One process holds the whole model; two share it, each at most one tensor over half.
    assert one["theta_share"] == [1.0] and sum(two["theta_share"]) == pytest.approx(1.0)
    assert sum(two["fsdp_share"]) == pytest.approx(1.0)
    assert list(tmp_path.iterdir()) == []  # the state files went with the temp dir
    # A rank's memory by part: every stage, adding up to the largest rank's peak above idle.
    for node in (one, two):
        parts = node["memory_parts"]
        assert [p["part"] for p in parts] == [*(s for s, _ in node_work.STAGES), "peak"]
        total = sum(p["mb"] for p in parts)
        assert total == pytest.approx(max(node["peak_rss_above_idle_mb"]), abs=0.01)


def test_a_model_of_its_own_shape_is_a_preset_run_configs_accept_while_it_runs() -> None:
    with node_work.registered(None, ctx_len=64) as name:
        run = RunConfig(name="bench", model=name, inner_steps=1, batch_size=4, rounds=1)
        assert get_preset(run.model).ctx_len == 64
    assert name not in runconfig.MODEL_PRESETS and name not in PRESETS


def test_memory_parts_add_up_to_the_peak_above_idle_with_file_pages_apart() -> None:
    idle = {"rss": 99.0, "file": 40.0, "hwm": 100.0}
    marks, rss, file = {}, 100.0, 40.0
    for i, (stage, _) in enumerate(node_work.STAGES):
        rss, file = rss + 10.0 * (i + 1), file + i
        marks[stage] = {"rss": rss, "file": file, "hwm": rss + 5.0}
    parts = node_work.memory_parts(marks, idle)
    assert [p["mb"] for p in parts[:-1]] == [10.0 * (i + 1) for i in range(len(node_work.STAGES))]
    assert [p["file_mb"] for p in parts[:-1]] == [float(i) for i in range(len(node_work.STAGES))]
    assert parts[-1] == {"part": "peak", "what": node_work.PEAK[1], "mb": 5.0, "file_mb": 0.0}
    assert sum(p["mb"] for p in parts) == marks["later"]["hwm"] - idle["hwm"]
