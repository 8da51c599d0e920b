"""``sparseloco bench project``: the projection's arithmetic and the command around it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from node.cli import main
from node.research.bench.projection import Assumptions, Row, project, train_seconds

#: Small round numbers, so every expected value below is worked out by hand.
HAND = Assumptions(
    sizes=(1e9,),
    links_mbit=(800.0,),
    peers=4,
    inner_steps=10,
    gpus=1,
    mfu=0.5,
    peak_flops=1e12,
    tokens_per_step=1000,
    bits_per_param=0.8,
    cpu_work_ns=10.0,
    cpu_overlappable_ns=2.0,
)


def _by_method(rows: list[Row]) -> dict[str, Row]:
    return {r.method: r for r in rows}


def test_a_hand_computed_round() -> None:
    rows = _by_method(project(HAND))
    s = rows["sparseloco, CPU work"]
    # 6 · 1e9 · 1000 · 10 / (1 · 1e12 · 0.5) = 120 s of training.
    assert s.train_s == pytest.approx(120.0)
    # 0.8 bits/param · 1e9 = 1e8 bytes; at 800 Mbit/s 1 s up, 4 peers' worth 4 s down.
    assert (s.up_s, s.down_s) == (pytest.approx(1.0), pytest.approx(4.0))
    assert s.bytes_moved == pytest.approx(5e8)
    assert s.work_s == pytest.approx(10.0)  # 10 ns/param
    assert s.round_s == pytest.approx(120 + 10 + 1 + 4)
    # Overlap: max(120, 1 + 4) + the 8 ns/param that stay on the path.
    assert s.round_overlap_s == pytest.approx(128.0)
    assert s.util == pytest.approx(120 / 135) and s.util_overlap == pytest.approx(120 / 128)
    # Ring all-reduce among 4 nodes: each sends 2 · 3/4 of 4 GB (fp32): 6 GB, 60 s at 800 Mbit/s.
    ring = rows["DiLoCo fp32, ring all-reduce"]
    assert ring.comm_s == pytest.approx(60.0) and ring.round_s == pytest.approx(180.0)
    assert ring.round_overlap_s == pytest.approx(120.0)
    # Through the store in bf16: 2 GB up (20 s), 8 GB down (80 s).
    store = rows["DiLoCo bf16, via the store"]
    assert (store.up_s, store.down_s) == (pytest.approx(20.0), pytest.approx(80.0))
    # DDP: 10 steps, each a bf16 ring all-reduce of 2 · 3/4 · 2 GB = 3 GB: 30 s a step.
    ddp = rows["DDP bf16, all-reduce per step"]
    assert ddp.comm_s == pytest.approx(300.0) and ddp.round_overlap_s == pytest.approx(300.0)


def test_a_sharded_node_does_the_fixed_part_and_its_share_of_the_rest() -> None:
    a = HAND.model_copy(update={"gpus": 4, "shard_fixed_ns": 1.0, "shard_scaled_ns": 8.0})
    rows = _by_method(project(a))
    s = rows["sparseloco, CPU work sharded over the ranks"]
    assert s.work_s == pytest.approx(3.0)  # (1 + 8 / 4) ns/param · 1e9
    # Its overlappable share is the single process's (2 of 10 ns/param): 0.6 s of 3.
    assert s.round_overlap_s == pytest.approx(max(s.train_s, 5.0) + 2.4)


def test_default_training_time_is_the_stated_formula() -> None:
    a = Assumptions()
    expected = 6 * 1e9 * (8 * 16 * 2048) * 30 / (8 * 989e12 * 0.40)
    assert train_seconds(a, 1e9) == pytest.approx(expected)
    assert train_seconds(a, 1e9) == pytest.approx(14.91, abs=0.01)


def test_doubling_the_link_halves_every_transfer() -> None:
    slow = project(Assumptions(links_mbit=(100.0,)))
    fast = project(Assumptions(links_mbit=(200.0,)))
    assert len(slow) == len(fast) == 18
    for s, f in zip(slow, fast, strict=True):
        assert f.up_s == pytest.approx(s.up_s / 2) and f.down_s == pytest.approx(s.down_s / 2)
        assert f.comm_s == pytest.approx(s.comm_s / 2)
        assert (f.train_s, f.work_s) == (s.train_s, s.work_s)


def test_overlap_never_lowers_utilisation_and_bytes_rank_the_methods() -> None:
    rows = project()
    assert len(rows) == 3 * 2 * 6
    for r in rows:
        assert 0 < r.util <= r.util_overlap <= 1
    for n in (1e9, 8e9, 70e9):
        moved = _by_method([r for r in rows if r.params == n and r.link_mbit == 100.0])
        order = [
            "sparseloco, CPU work",
            "DiLoCo fp32, ring all-reduce",
            "DiLoCo bf16, via the store",
            "DDP bf16, all-reduce per step",
        ]
        assert [moved[m].bytes_moved for m in order] == sorted(moved[m].bytes_moved for m in order)


def test_every_term_is_linear_so_utilisation_does_not_depend_on_size() -> None:
    small, large = project(Assumptions(sizes=(1e9,))), project(Assumptions(sizes=(2e9,)))
    for s, l in zip(small, large, strict=True):
        assert l.round_s == pytest.approx(2 * s.round_s)
        assert l.util == pytest.approx(s.util) and l.util_overlap == pytest.approx(s.util_overlap)


def test_measured_defaults_match_the_readme_numbers() -> None:
    a = Assumptions()
    assert a.bits_per_param == 0.1445  # docs/benchmarks.md §1, EF-like, k=64 (format 2)
    # docs/benchmarks.md §10, the quiet rerun: the parts on the round's path add up to the total.
    assert a.cpu_work_ns == pytest.approx(0.6 + 4.9 + 7.1 + 0.0 + 3.6 + 9.7 + 1.7 + 0.9)
    assert (a.peers, a.inner_steps, a.gpus, a.mfu) == (16, 30, 8, 0.40)


def test_command_prints_the_tables_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "projection.json"
    argv = [
        "bench",
        "project",
        "--sizes",
        "1B,8e9",
        "--links",
        "100",
        "-G",
        "8",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| model | link | node work | train s |" in text
    assert "| 8 B | 100 Mbit/s | CPU, one process |" in text
    assert "| 8 B | 100 Mbit/s | CPU, 8 ranks |" in text
    report = json.loads(out.read_text())
    assert report["assumptions"]["peers"] == 8
    assert report["assumptions"]["sizes"] == [1e9, 8e9]
    expected = project(Assumptions(sizes=(1e9, 8e9), links_mbit=(100.0,), peers=8))
    assert [r["round_s"] for r in report["rows"]] == [r.round_s for r in expected]
    assert all(0 < r["util"] <= r["util_overlap"] <= 1 for r in report["rows"])


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--mfu", "0"], "--mfu"), (["--sizes", "1X"], "--sizes"), (["--links", "0"], "--links")],
)
def test_a_bad_flag_is_refused_by_name(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "project", *flags]) == 2
    assert named in capsys.readouterr().err


def test_python_dash_m_node_runs_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "node", "bench", "project"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "| 70 B | 1 Gbit/s | device (assumed) |" in done.stdout
    assert "| 70 B | 1 Gbit/s | DDP bf16, all-reduce per step |" in done.stdout
