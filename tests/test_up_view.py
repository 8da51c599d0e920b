"""``sparseloco up``'s view numbers rounds as the API and the logs do: from 0, with a count.

Round 0 closing is ``round=0 done=1/2`` in the log line, and the live line says which round is
in progress and how many are done; a finished run says so, and its members show ``finished``.
"""

from __future__ import annotations

import logging

import pytest
from rich.console import Console

from node.cluster.view import UpView
from protocol.messages import (
    MemberState,
    MemberView,
    RoundReport,
    RoundState,
    RoundSummary,
    StatusView,
)
from protocol.runconfig import RunConfig

RUN = RunConfig(name="view", rounds=2)
FP = "a" * 32


def status(round_: int, state: RoundState, member_state: MemberState) -> StatusView:
    closed = [
        RoundSummary(
            round=r,
            state=RoundState.CLOSED,
            gather=["n0"],
            reports={"n0": RoundReport(fingerprint=FP, eval_loss=3.0)},
        )
        for r in range(round_)
    ]
    member = MemberView(node_id="n0", state=member_state, slot=0, joined_round=0, last_seen_s=0)
    return StatusView(
        run_id=RUN.run_id, run=RUN, round=round_, state=state, members=[member], rounds=closed
    )


def rendered(view: UpView, st: StatusView) -> str:
    console = Console(width=120, record=True)
    closed = [r for r in st.rounds if r.state == RoundState.CLOSED]
    console.print(view._render(st, closed))
    return console.export_text()


def test_rounds_are_numbered_from_zero_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sparseloco.up")
    view = UpView(rounds=2, nodes=1)
    view.tty, view.live = False, None
    running = status(1, RoundState.OPEN, MemberState.ACTIVE)
    view.update(running)
    assert "event=round_closed round=0 done=1/2 " in caplog.text
    assert "round 1 (open), 1 of 2 done" in rendered(view, running)
    finished = status(2, RoundState.FINISHED, MemberState.FINISHED)
    view.update(finished)
    assert "event=round_closed round=1 done=2/2 " in caplog.text
    text = rendered(view, finished)
    assert "finished: 2 of 2 rounds done" in text and "finished" in text.split("n0", 1)[1]


def test_rounds_without_evaluation_keep_the_newest_loss_and_the_summary_ends(capsys) -> None:
    """Rounds off the evaluation schedule report ``eval_loss=None``: the table keeps each node's
    newest loss, and the summary goes from the first measured loss to the last."""
    losses = [3.0, None, 2.5, None]
    closed = [
        RoundSummary(
            round=r,
            state=RoundState.CLOSED,
            gather=["n0"],
            reports={"n0": RoundReport(fingerprint=FP, eval_loss=loss, train_loss=3.1)},
        )
        for r, loss in enumerate(losses)
    ]
    member = MemberView(
        node_id="n0", state=MemberState.ACTIVE, slot=0, joined_round=0, last_seen_s=0
    )
    st = StatusView(
        run_id=RUN.run_id, run=RUN, round=4, state=RoundState.OPEN, members=[member], rounds=closed
    )
    view = UpView(rounds=6, nodes=1)
    view.tty, view.live = False, None
    view.update(st)
    assert "2.5000" in rendered(view, st).split("n0", 1)[1]
    rounds = [{"eval_loss": None}, {"eval_loss": 3.0}, {"eval_loss": None}, {"eval_loss": 2.5}]
    result = {
        "rounds": rounds,
        "final_eval_loss": 2.5,
        "fingerprints_agree": True,
        "run_id": RUN.run_id,
        "nodes": 1,
        "wall_seconds": 1.0,
        "run_dir": "runs/x",
    }
    view.summary(result)
    assert "eval loss 3.0000 -> 2.5000" in capsys.readouterr().out
