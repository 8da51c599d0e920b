"""``sparseloco bench up``'s reading of ``up``'s log lines into phases (the runs themselves are
``sparseloco up`` as typed, which ``tests/test_network_run.py`` runs)."""

from __future__ import annotations

from datetime import datetime

import pytest

from node.research.bench.up_time import PHASES, phases, table

LOG = """\
2026-12-06 12:12:22,500 INFO sparseloco.seaweed event=store_started endpoint=http://x bucket=b
2026-12-06 12:12:23,500 INFO sparseloco.up event=up_started run_dir=r coordinator=c store=s
  a progress line without a stamp
2026-12-06 12:12:32,000 INFO sparseloco.up event=round_closed round=0 done=1/3 gather=a
2026-12-06 12:12:33,000 INFO sparseloco.up event=round_closed round=1 done=2/3 gather=a
2026-12-06 12:12:34,000 INFO sparseloco.up event=round_closed round=2 done=3/3 gather=a
2026-12-06 12:12:34,250 INFO sparseloco.up event=final_model_kept path=p
2026-12-06 12:12:36,750 INFO sparseloco.seaweed event=store_stopped code=0
"""


def _at(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_phases_add_up_to_the_wall_time() -> None:
    started, ended = _at("2026-12-06 12:12:20,000"), _at("2026-12-06 12:12:37,000")
    got = phases(LOG, started, ended)
    assert list(got) == [name for name, _ in PHASES]
    assert got == pytest.approx(
        {
            "python and store": 2.5,
            "coordinator": 1.0,
            "nodes start, round 0": 8.5,
            "other rounds": 2.0,
            "nodes exit": 0.25,
            "store stop, exit": 2.75,
        }
    )
    assert sum(got.values()) == pytest.approx(ended - started)


def test_a_phase_whose_line_never_came_is_left_out_and_shown_as_a_dash() -> None:
    log = "\n".join(line for line in LOG.splitlines() if "final_model_kept" not in line)
    got = phases(log, _at("2026-12-06 12:12:20,000"), _at("2026-12-06 12:12:37,000"))
    assert "nodes exit" not in got and got["store stop, exit"] == pytest.approx(3.0)
    run = {
        "run": 0, "numba_cache": "cold", "load_1m_at_start": 4.0,
        "cpu_pressure_avg10_at_start": None, "wall_s": 17.0, "summary_s": 16.5, "phases_s": got,
    }  # fmt: skip
    row = table([run]).splitlines()[-1]
    assert row.startswith("| 0 | cold | 4.0 | - | 17.0 | 16.5 |") and "| - |" in row
