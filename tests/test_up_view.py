"""``sparseloco up``'s view numbers rounds as the API and the logs do: from 0, with a count.

Round 0 closing is ``round=0 done=1/2`` in the log line, and the live line says which round is
in progress and how many are done; a finished run says so, and its members show ``finished``.
"""

from __future__ import annotations

import io
import logging

import pytest
from rich.console import Console

from node.cluster.view import UpView
from protocol.messages import MemberState, RoundState
from protocol.reports import RoundReport
from protocol.runconfig import RunConfig
from protocol.status import MemberView, RoundSummary, StatusView

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
    out = capsys.readouterr().out
    assert "eval loss 3.0000 -> 2.5000" in out


def test_the_closing_summary_fits_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    """The summary was one line of 121 characters, which an 80-column terminal wrapped."""
    view = UpView(rounds=40, nodes=32)
    view.tty, view.live = False, None
    result = {
        "rounds": [{"eval_loss": 12.3456}] * 40,
        "final_eval_loss": 10.1234,
        "fingerprints_agree": True,
        "run_id": RUN.run_id,
        "nodes": 32,
        "wall_seconds": 12345.6,
        "run_dir": "runs/up-20261206-095959",
    }
    view.summary(result)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and max(map(len, lines)) <= 80, lines


def test_the_table_fits_80_columns_with_the_widest_values() -> None:
    """32 nodes with the longest state, four-digit losses and the widest byte counts, and
    fingerprints that differ: every line within 80 columns, no cell cut or wrapped."""
    nodes = [f"node-{i}" for i in range(32)]
    report = RoundReport(
        fingerprint=FP, eval_loss=12.3456, train_loss=12.3456, bytes_up=333_333_333
    )
    closed = [
        RoundSummary(
            round=r,
            state=RoundState.CLOSED,
            gather=nodes,
            reports=dict.fromkeys(nodes, report.model_copy(update={"bytes_down": 999_900_000})),
            fingerprints={n: str(i % 3) * 32 for i, n in enumerate(nodes)},
        )
        for r in range(3)
    ]
    members = [
        MemberView(node_id=n, state=MemberState.TIMED_OUT, slot=i, joined_round=0, last_seen_s=0)
        for i, n in enumerate(nodes)
    ]
    st = StatusView(
        run_id=RUN.run_id, run=RUN, round=3, state=RoundState.OPEN, members=members, rounds=closed
    )
    view = UpView(rounds=5, nodes=32)
    view.tty, view.live = False, None
    view.update(st)
    console = Console(width=80, record=True)
    console.print(view._render(st, closed))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in "".join(lines)
    rows = {line.split()[0]: line.split() for line in lines if line.strip().startswith("node-")}
    assert set(rows) == set(nodes)
    # node, state (two words), train, eval, up (two words), down (two words), gathered
    assert all(
        row == [n, "timed", "out", "12.3456", "12.3456", "1000.0", "MB", "3.0", "GB", "yes"]
        for n, row in rows.items()
    ), rows["node-31"]
    assert "round 3 (open), 3 of 5 done" in lines
    assert "last gather: 32 of 32 nodes, fingerprints DIFFER (3 values)" in lines


def test_round_lines_without_a_terminal_carry_losses_and_bytes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "sparseloco.up")
    reports = {
        "n0": RoundReport(fingerprint=FP, train_loss=3.5, eval_loss=3, bytes_up=10, bytes_down=30),
        "n1": RoundReport(fingerprint=FP, train_loss=2.5, bytes_up=20, bytes_down=40),
    }
    closed = RoundSummary(round=0, state=RoundState.CLOSED, gather=["n0", "n1"], reports=reports)
    st = StatusView(
        run_id=RUN.run_id, run=RUN, round=1, state=RoundState.OPEN, members=[], rounds=[closed]
    )
    view = UpView(rounds=2, nodes=2)
    view.tty, view.live = False, None
    view.update(st)
    assert (
        "round=0 done=1/2 gather=n0,n1 excluded=- train_loss=3.0000 eval_loss=3.0000"
        " bytes_up=30 bytes_down=70 " in caplog.text
    )


def test_log_lines_go_to_the_run_folder_while_the_table_is_live(tmp_path) -> None:
    """On a terminal, this process's log lines would run into the live table: they go to
    ``logs/up.log`` in the run folder while it is on, and to the terminal again after."""
    terminal = io.StringIO()
    handler = logging.StreamHandler(terminal)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        view = UpView(rounds=2, nodes=1, log_path=tmp_path / "logs" / "up.log")
        view.tty = True
        view.console = Console(file=io.StringIO(), width=80, force_terminal=True)
        with view:
            logging.getLogger("sparseloco.up").info("event=up_started while live")
        logging.getLogger("sparseloco.up").info("event=after the table")
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert "while live" in (tmp_path / "logs" / "up.log").read_text()
    assert "while live" not in terminal.getvalue()
    assert "after the table" in terminal.getvalue()
    assert "after the table" not in (tmp_path / "logs" / "up.log").read_text()
