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
