"""The benchmark commands run end to end on tiny inputs and write what they promise."""

from __future__ import annotations

import json
from pathlib import Path

from node.cli import main


def test_bench_quality_writes_results_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "quality"
    assert (
        main(
            [
                "bench",
                "quality",
                "--preset",
                "tiny",
                "--rounds",
                "1",
                "--algos",
                "sparseloco,diloco",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"sparseloco", "diloco"}
    assert (
        summary["sparseloco"]["bytes_per_round_per_worker"]
        < (summary["diloco"]["bytes_per_round_per_worker"])
    )
    assert (out / "eval_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| sparseloco |" in (out / "summary.md").read_text()


def test_bench_codec_reports_every_target(tmp_path: Path) -> None:
    out = tmp_path / "codec.json"
    assert (
        main(
            [
                "bench",
                "codec",
                "--preset",
                "tiny",
                "--peers",
                "3",
                "--repeat",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert {"size", "speed", "memory"} <= set(res)
    ops = [row["op"] for row in res["speed"]["rows"]]
    assert ops[0].startswith("encode") and ops[1].startswith("decode + aggregate")
    assert all(row["ours_s"] > 0 and row["naive_s"] > 0 for row in res["speed"]["rows"])
    assert res["speed"]["encode_memcpy"]["memcpy_s"] > 0
    assert [row["impl"] for row in res["memory"]["rows"]] == ["lazy", "ours", "naive"]
