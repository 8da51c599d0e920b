"""The chaos verdicts that a loaded machine used to flip: recovery and loss (no processes).

Both are counted in the run's own rounds (``results``): recovery from the round a node is back
in the run, the loss after equal numbers of outer steps. Made-up statuses stand in for a run on
a machine so slow that a restart spans rounds and some rounds close empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from protocol.messages import RoundState
from protocol.reports import RoundReport
from protocol.runconfig import RunConfig
from protocol.status import RoundSummary, StatusView

from .results import check_recovery, compare_to_baseline, rejoins, trajectory
from .scenario import Scenario, at

FP = "a" * 32
NODES = ["node-0", "node-1", "node-2"]
KILLED = Scenario(
    name="k",
    run=RunConfig(rounds=12),
    nodes=3,
    steps=(at(2, "kill_node", "node-1"), at(2, "restart_node", "node-1", when="closed")),
)
STRAGGLER = Scenario(name="s", run=RunConfig(rounds=12), nodes=3, faults={"node-0": "slow:15@6"})


def _status(gathers: list[list[str]], losses: Sequence[float | None] | None = None) -> StatusView:
    rounds = []
    for r, gather in enumerate(gathers):
        loss = losses[r] if losses else None
        reports = {n: RoundReport(fingerprint=FP, eval_loss=loss) for n in NODES}
        rounds.append(
            RoundSummary(
                round=r,
                state=RoundState.CLOSED,
                gather=gather,
                fingerprints=dict.fromkeys(NODES, FP),
                reports=reports,
            )
        )
    return StatusView(
        run_id="t-0", run=RunConfig(rounds=len(gathers)), round=len(gathers),
        state=RoundState.FINISHED, members=[], rounds=rounds,
    )  # fmt: skip


def _gathers(absent: dict[str, range]) -> list[list[str]]:
    return [[n for n in NODES if r not in absent.get(n, range(0))] for r in range(12)]


def test_rejoins_reads_the_coordinators_join_lines(tmp_path: Path) -> None:
    log = tmp_path / "coordinator-1.log"
    log.write_text(
        "2026-12-01 18:09:02,857 INFO sparseloco.coordinator.membership event=joined"
        " node=node-1 slot=0 joined_round=0 round=0 returning=False instance=dfeea54960fe2980\n"
        "2026-12-01 18:10:06,137 INFO sparseloco.coordinator.membership event=joined"
        " node=node-2 slot=2 joined_round=0 round=5 returning=True instance=8c202e401b9618d0\n"
        "2026-12-01 18:09:59,835 INFO sparseloco.coordinator.membership event=joined"
        " node=node-1 slot=0 joined_round=5 round=7 returning=True instance=cb396dc858ade534\n"
    )
    assert rejoins([log]) == {"node-2": [5], "node-1": [7]}


def test_recovery_counts_from_the_round_the_node_is_back() -> None:
    # Killed in round 2; its process took until round 6 to start and join (a loaded machine);
    # gathered in round 7, one round after its return.
    status = _status(_gathers({"node-1": range(2, 7)}))
    assert check_recovery(KILLED, status, {"node-1": [6]}) == []
    # Counted from the fault's round, the same run would fail: 5 rounds > 3.
    assert check_recovery(KILLED, status, {})
    # Back in round 6 but gathered only in round 10: the protocol's own delay, a failure.
    slow = check_recovery(KILLED, _status(_gathers({"node-1": range(2, 10)})), {"node-1": [6]})
    assert len(slow) == 1 and "back in the run in round 6" in slow[0].detail


def test_a_coordinator_outage_after_the_return_holds_the_node_out_again() -> None:
    # Back in round 4, the coordinator killed in round 5: it can neither replay nor submit
    # until it is back, so its return counts from round 5 (gathered in 8: 3 rounds).
    outage = Scenario(
        name="o", run=RunConfig(rounds=12), nodes=3,
        steps=(*KILLED.steps, at(5, "kill_coordinator"), at(5, "restart_coordinator")),
    )  # fmt: skip
    status = _status(_gathers({"node-1": range(2, 8)}))
    assert check_recovery(outage, status, {"node-1": [4]}) == []
    assert check_recovery(KILLED, status, {"node-1": [4]})  # without the outage: 4 > 3
    # An outage after the node was gathered again changes nothing.
    late = replace(outage, steps=(*KILLED.steps, at(9, "kill_coordinator")))
    assert check_recovery(late, status, {"node-1": [4]})


def test_a_node_back_in_the_run_but_never_gathered_fails() -> None:
    status = _status(_gathers({"node-1": range(2, 12)}))
    out = check_recovery(KILLED, status, {"node-1": [4]})
    assert len(out) == 1 and "never back in a gather set" in out[0].detail
    # A join before the fault is not a return from it.
    assert check_recovery(KILLED, _status(_gathers({"node-1": range(2, 7)})), {"node-1": [1]})


def test_a_straggler_never_left_so_its_count_starts_at_the_fault() -> None:
    assert check_recovery(STRAGGLER, _status(_gathers({"node-0": range(6, 7)})), {}) == []
    assert check_recovery(STRAGGLER, _status(_gathers({"node-0": range(6, 10)})), {})


def _result(status: StatusView) -> dict[str, Any]:
    path = trajectory(status)
    final = path[-1][2] if path else None
    return {"final_eval_loss": final, "trajectory": path, "wall_s": 1.0, "failures": []}


def test_trajectory_counts_steps_and_contributions_that_reached_the_model() -> None:
    gathers = _gathers({n: range(1, 4) for n in NODES})  # rounds 1-3 closed empty
    gathers[5] = ["node-0"]
    path = trajectory(_status(gathers, [5.0 - 0.1 * r for r in range(12)]))
    assert [r for r, _, _ in path] == [0, 4, 5, 6, 7, 8, 9, 10, 11]
    assert [n for _, n, _ in path][:4] == [3, 6, 7, 10]
    assert path[1][2] == 4.6


def _curve(contributions: int) -> float:
    """A made-up loss that falls with the contributions gathered."""
    return 5.0 * 0.97**contributions


def _run(gathers: list[list[str]], scale: float = 1.0) -> dict[str, Any]:
    total, losses = 0, []
    for gather in gathers:
        total += len(gather)
        losses.append(_curve(total) * scale)
    return _result(_status(gathers, losses))


#: node-1 down for rounds 2-5, node-2 for 3-7: 27 payloads gathered of 36.
FAULTED = _gathers({"node-1": range(2, 6), "node-2": range(3, 8)})


def test_loss_is_compared_at_equal_contributions() -> None:
    # Final to final the faulted run is far behind (it gathered 9 payloads fewer); where the
    # fault-free run had gathered as many, it is 1 % behind.
    baseline = _run(_gathers({}))
    result = _run(FAULTED, scale=1.01)
    assert result["final_eval_loss"] / baseline["final_eval_loss"] - 1 > 0.3
    compare_to_baseline(result, baseline, 0.05)
    assert result["failures"] == []
    assert abs(result["loss_rel_diff"] - 0.01) < 1e-9
    assert result["loss_compared"] == {"contributions": 27, "round": 11, "baseline_round": 8}


def test_a_baseline_slowed_by_load_is_compared_at_its_end() -> None:
    # The fault-free run lost rounds 1-3 to a loaded machine (closed empty), 27 payloads in
    # all; the scenario gathered 32. Ahead of that baseline, the faults did no harm.
    baseline = _run(_gathers({n: range(1, 4) for n in NODES}))
    result = _run(_gathers({"node-1": range(2, 6)}), scale=1.01)
    compare_to_baseline(result, baseline, 0.05)
    assert result["failures"] == [] and result["loss_rel_diff"] < 0
    assert result["loss_compared"] == {"contributions": 32, "round": 11, "baseline_round": 11}


def test_a_scenario_that_trains_worse_for_its_contributions_fails() -> None:
    baseline = _run(_gathers({}))
    worse = _run(FAULTED, scale=1.1)
    compare_to_baseline(worse, baseline, 0.05)
    assert len(worse["failures"]) == 1 and "after 27 contributions" in worse["failures"][0]
    # Without a loss to compare, the check says so rather than passing.
    empty = _result(_status(_gathers({}), None))
    compare_to_baseline(empty, baseline, 0.05)
    assert empty["failures"] == ["[e] run: no eval loss to compare with the fault-free run"]
