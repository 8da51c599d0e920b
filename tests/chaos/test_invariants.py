"""The invariant checks catch what they claim to, on made-up statuses (no processes)."""

from __future__ import annotations

from pathlib import Path

from protocol.keys import checkpoint_key
from protocol.messages import CheckpointInfo, RoundState
from protocol.reports import Mass, RoundReport
from protocol.runconfig import RunConfig
from protocol.status import RoundSummary, StatusView

from .invariants import (
    check_agreement,
    check_close_logs,
    check_mass,
    check_retention,
    check_round_numbers,
)
from .table import render_markdown

A, B = "a" * 32, "b" * 32


def _status(*rounds: RoundSummary) -> StatusView:
    return StatusView(
        run_id="t-0", run=RunConfig(), round=len(rounds), state=RoundState.OPEN,
        members=[], rounds=list(rounds),
    )  # fmt: skip


def _round(
    r: int,
    fps: dict[str, str],
    *,
    gather: list[str] | None = None,
    excluded: dict[str, str] | None = None,
    mass: Mass | None = None,
) -> RoundSummary:
    return RoundSummary(
        round=r,
        state=RoundState.CLOSED,
        gather=gather or [],
        excluded=excluded or {},
        fingerprints=fps,
        reports={n: RoundReport(fingerprint=fp, mass=mass) for n, fp in fps.items()},
    )


def test_agreement_flags_an_unexplained_dissenter_only() -> None:
    ok, _ = check_agreement(_status(_round(0, {"n0": A, "n1": A})))
    assert ok == []
    bad, records = check_agreement(_status(_round(0, {"n0": A, "n1": A, "n2": B})))
    assert [f.invariant for f in bad] == ["a"] and "n2" in bad[0].detail
    assert records[0]["ok"] is False
    # Corrupted after round 0, excluded as wrong base when it trains on it in round 1: excused.
    excused, records = check_agreement(
        _status(
            _round(0, {"n0": A, "n1": A, "n2": B}),
            _round(1, {"n0": A, "n1": A}, excluded={"n2": "wrong base fingerprint"}),
        )
    )
    assert excused == [] and records[0]["excused"] == ["n2"]


def test_mass_must_balance_and_an_excluded_node_sends_nothing() -> None:
    good = Mass(computed=10.0, sent=4.0, held=6.0, scale=20.0)
    assert check_mass(_status(_round(0, {"n0": A}, gather=["n0"], mass=good))) == []
    lost = Mass(computed=10.0, sent=4.0, held=5.0, scale=20.0)
    assert check_mass(_status(_round(0, {"n0": A}, gather=["n0"], mass=lost)))
    out = check_mass(_status(_round(0, {"n0": A}, gather=[], mass=good)))
    assert any("not 0" in f.detail for f in out)
    replay = _round(0, {"n0": A}, gather=["n0"])  # a catch-up report: nothing trained
    assert check_mass(_status(replay)) == []


def test_round_closed_twice_is_caught(tmp_path: Path) -> None:
    assert check_round_numbers(_status(_round(0, {}), _round(2, {})))
    log1, log2 = tmp_path / "coordinator-1.log", tmp_path / "coordinator-2.log"
    log1.write_text("x event=round_closed round=0 gather=1\nx event=round_closed round=1 g\n")
    log2.write_text("x event=round_closed round=1 gather=1\n")
    out = check_close_logs([log1, log2])
    assert [f.round for f in out] == [1]


def test_table_renders_a_result() -> None:
    result = {
        "scenario": "s", "nodes": 3, "rounds": 2, "rounds_closed": 2,
        "faults": [{"round": 1, "action": "kill_node", "target": "node-1"}],
        "recovery": [{"node": "node-1", "round": 1, "back_in_gather": 2, "rounds_to_recover": 1}],
        "agreement": [{"ok": True, "excused": []}, {"ok": True, "excused": []}],
        "final_eval_loss": 3.0, "baseline_eval_loss": 3.03, "loss_rel_diff": 0.0099,
        "failures": [],
    }  # fmt: skip
    text = render_markdown([result])
    assert "| s | 3 | 1 | 2/2 | 2/2 | 3.0000 | 3.0300 | 1.0% | 0 |" in text
    assert "| 1 | kill_node | node-1 | 2 | 1 |" in text


class _Keys:
    """The one read ``check_retention`` makes of the bucket: the run's keys."""

    def __init__(self, keys: list[str]) -> None:
        self.listed = keys

    def keys(self, prefix: str) -> list[str]:
        return [k for k in self.listed if k.startswith(prefix)]


def _checkpoints_kept(kept: list[int], newest: int) -> list[str]:
    status = _status(*(_round(r, {"n0": A}) for r in range(newest + 1)))
    info = CheckpointInfo(
        run_id=status.run_id, round=newest, fingerprint=A, key="k", sha256="0" * 64, size=1,
        node_id="n0", created_at=0.0,
    )  # fmt: skip
    status = status.model_copy(update={"checkpoint": info})
    keys = [checkpoint_key("p", status.run_id, r) for r in kept]
    return [f.detail for f in check_retention(status, _Keys(keys), "p")]  # type: ignore[arg-type]


def test_retention_allows_the_newest_checkpoint_its_pruning_pass_and_no_more() -> None:
    keep = RunConfig().keep_checkpoints
    newest = 10 * (keep + 2)
    several = [newest - 10 * i for i in range(keep + 2)][::-1]
    assert _checkpoints_kept(several[-keep:], newest) == []
    # Just committed, its pruning pass still under way: one more than ``keep`` for a moment.
    assert _checkpoints_kept(several[-keep - 1 :], newest) == []
    assert _checkpoints_kept(several, newest) == [
        f"{keep + 2} checkpoints kept ({several}), keep {keep}"
    ]
    # Without the newest committed, nothing excuses an extra one.
    assert _checkpoints_kept(several[:-1], newest)
