"""``sparseloco simulate`` end to end on the tiny preset, through the real console script."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from node.cli import build_parser, main
from node.research.simulate import build_config, simulate
from protocol.codec import Payload
from protocol.errors import ConfigError

REQUIRED = {
    "final_eval_loss",
    "eval_loss_curve",
    "bytes_sent_per_worker",
    "tokens_per_worker",
    "wall_seconds",
    "config",
}


@pytest.fixture(scope="module")
def tiny_results() -> dict[str, dict]:
    return {a: simulate(build_config("tiny", algo=a)) for a in ("sparseloco", "diloco", "ddp")}


def test_every_algorithm_learns_and_reports(tiny_results: dict[str, dict]) -> None:
    for algo, res in tiny_results.items():
        assert set(res) >= REQUIRED, algo
        curve = res["eval_loss_curve"]
        assert [r for r, _ in curve] == list(range(res["config"]["rounds"] + 1))
        assert curve[-1][1] < curve[0][1], f"{algo} did not reduce the held-out loss"
        assert res["final_eval_loss"] == curve[-1][1]
        assert res["config"]["algo"] == algo


def test_equal_token_budgets(tiny_results: dict[str, dict]) -> None:
    tokens = {res["tokens_per_worker"] for res in tiny_results.values()}
    assert len(tokens) == 1


def test_bytes_sent(tiny_results: dict[str, dict]) -> None:
    n = tiny_results["diloco"]["parameters"]
    cfg = tiny_results["diloco"]["config"]
    assert tiny_results["diloco"]["bytes_sent_per_worker"] == 4 * n * cfg["rounds"]
    assert tiny_results["ddp"]["bytes_sent_per_worker"] == (
        4 * n * cfg["rounds"] * cfg["inner_steps"]
    )
    # k=64 of 4096 at 2 bits plus ~7.5 bits per index: far below a dense fp32 copy.
    assert tiny_results["sparseloco"]["bytes_per_round_per_worker"] < (
        tiny_results["diloco"]["bytes_per_round_per_worker"] / 100
    )


def test_deterministic_for_a_seed() -> None:
    a = simulate(build_config("tiny", algo="sparseloco", rounds=2))
    b = simulate(build_config("tiny", algo="sparseloco", rounds=2))
    c = simulate(build_config("tiny", algo="sparseloco", rounds=2, seed=1))
    assert a["final_fingerprint"] == b["final_fingerprint"]
    assert a["eval_loss_curve"] == b["eval_loss_curve"]
    assert a["final_fingerprint"] != c["final_fingerprint"]


def test_merge_at_the_last_step_is_delayed_and_earlier_is_not() -> None:
    # Merging round r's aggregate after all H steps of round r+1 trains exactly what "delayed"
    # trains (the pseudo-gradient against θ_{r+1} of θ_trained + θ_{r+1} - θ_r); the loss curve
    # is the same, to the rounding of that sum.
    tiny = {"algo": "sparseloco", "rounds": 3}
    delayed = simulate(build_config("tiny", overlap="delayed", **tiny))
    late = simulate(build_config("tiny", overlap="merge", overlap_tau=10, **tiny))
    early = simulate(build_config("tiny", overlap="merge", overlap_tau=1, **tiny))
    losses = [[loss for _, loss in r["eval_loss_curve"]] for r in (delayed, late)]
    assert losses[1] == pytest.approx(losses[0], abs=1e-4)
    assert early["eval_loss_curve"][-1] != pytest.approx(delayed["eval_loss_curve"][-1], abs=1e-3)
    assert early["config"]["overlap_tau"] == 1


def test_a_merge_inside_the_first_step_is_neither_the_merge_after_it_nor_plain() -> None:
    tiny = {"algo": "sparseloco", "rounds": 3, "batch_size": 4}
    inside = simulate(build_config("tiny", overlap="merge", overlap_rows=1, **tiny))
    after = simulate(build_config("tiny", overlap="merge", overlap_tau=1, **tiny))
    plain = simulate(build_config("tiny", **tiny))
    prints = {r["final_fingerprint"] for r in (inside, after, plain)}
    assert len(prints) == 3
    assert inside["config"]["overlap_rows"] == 1
    with pytest.raises(ConfigError, match="overlap_rows=4 must be below batch_size=4"):
        build_config("tiny", overlap="merge", overlap_rows=4, **tiny)


def test_merge_with_the_estimate_at_the_last_step_is_eager_and_earlier_is_not() -> None:
    # Starting from θ less eager's estimate and taking it back at the merge: at τ = H that is
    # eager's training (the same start, the same pseudo-gradient); at τ = 1 it differs from
    # both eager and the merge without the estimate. Four rounds, so the estimate is in use
    # from round 2 on.
    tiny = {"algo": "sparseloco", "rounds": 4}
    eager = simulate(build_config("tiny", overlap="eager", **tiny))
    late = simulate(
        build_config("tiny", overlap="merge", overlap_tau=10, merge_estimate=True, **tiny)
    )
    early = simulate(
        build_config("tiny", overlap="merge", overlap_tau=1, merge_estimate=True, **tiny)
    )
    plain_merge = simulate(build_config("tiny", overlap="merge", overlap_tau=1, **tiny))
    losses = [[loss for _, loss in r["eval_loss_curve"]] for r in (eager, late)]
    assert losses[1] == pytest.approx(losses[0], abs=1e-4)
    last = [r["eval_loss_curve"][-1][1] for r in (eager, early, plain_merge)]
    assert last[1] != pytest.approx(last[0], abs=1e-3)
    assert last[1] != pytest.approx(last[2], abs=1e-3)
    assert early["config"]["merge_estimate"] is True
    with pytest.raises(ConfigError, match="merge-estimate"):
        build_config("tiny", overlap="eager", merge_estimate=True, **tiny)


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match="workers"):
        build_config("tiny", algo="sparseloco", workers=0)
    with pytest.raises(ConfigError, match="preset"):
        build_config("nope", algo="sparseloco")
    with pytest.raises(ConfigError, match="topk"):
        build_config("tiny", algo="sparseloco", topk=5000)
    assert main(["simulate", "--algo", "ddp", "--model", "huge"]) == 2


def test_cli_flags_are_pinned() -> None:
    parser = build_parser()
    sub = next(
        a
        for a in parser._actions
        if isinstance(a, argparse._SubParsersAction) and a.dest == "command"
    )
    sim = sub.choices["simulate"]
    flags = {s for a in sim._actions for s in a.option_strings}
    assert {
        "--algo",
        "--workers",
        "--inner-steps",
        "--rounds",
        "--data",
        "--preset",
        "--topk",
        "--seed",
        "--json",
        "--overlap-rows",
    } <= flags


def test_console_script_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"To be, or not to be, that is the question.\n" * 400)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "node.cli",
            "simulate",
            "--algo",
            "sparseloco",
            "--preset",
            "tiny",
            "--rounds",
            "2",
            "--data",
            str(data),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert set(res) >= REQUIRED
    assert res["config"]["data"] == str(data)
    assert res["config"]["rounds"] == 2


def test_simulate_refuses_a_device_this_machine_lacks_before_training() -> None:
    """``--device cuda:N`` on a machine torch sees no such GPU on: exit 2 with one line that
    says what torch sees, not a traceback mid-run."""
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "sparseloco"), "simulate", "--algo", "sparseloco",
         "--preset", "tiny", "--rounds", "1", "--device", missing],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"--device {missing}" in proc.stderr and "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- unequal workers

MIX_ONE_SLOW = [1.0, 1.0, 1.0, 1 / 3]
MIX_SPREAD = [1.0, 0.5, 0.333, 0.2]


def unequal(schedule: str, speeds: list[float] | None = None, **options: object) -> dict:
    """One tiny run (H = 10, batch 8, wall = 3 rounds × 10 step units) of four workers."""
    cfg = build_config(
        "tiny",
        algo="sparseloco",
        workers=4,
        speeds=speeds or MIX_ONE_SLOW,
        schedule=schedule,
        eval_final_only=True,
        **options,
    )
    return simulate(cfg)


@pytest.fixture
def headers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, str, int, int]]:
    """(round, node id, steps, tokens) of every payload the simulator reads back."""
    import node.research.simulate as sim_module

    seen: list[tuple[int, str, int, int]] = []
    real = sim_module.read_payload

    def spy(*args: Any, **kwargs: Any) -> Payload:
        payload = real(*args, **kwargs)
        seen.append((payload.round, payload.node_id, payload.steps, payload.tokens))
        return payload

    monkeypatch.setattr(sim_module, "read_payload", spy)
    return seen


def test_budget_steps_follow_each_workers_speed() -> None:
    # B is the median worker's whole round; worker w trains min(H, floor(B·v_w)) steps.
    plan = build_config(
        "tiny", algo="sparseloco", workers=4, speeds=MIX_ONE_SLOW, schedule="budget"
    )
    assert plan.round_plan().steps == (10, 10, 10, 3)  # B = 10
    plan = build_config("tiny", algo="sparseloco", workers=4, speeds=MIX_SPREAD, schedule="budget")
    assert plan.round_plan().steps == (10, 10, 8, 5)  # B = (20 + 30.03) / 2
    # At H = 30 a third of the speed is 10 steps, not 9 (float rounding costs no step)...
    third = build_config("bench", algo="sparseloco", speeds=MIX_ONE_SLOW, schedule="budget")
    assert third.round_plan().steps == (30, 30, 30, 10)
    # ... and 0.333 is a little less than a third.
    approx = build_config("bench", algo="sparseloco", speeds="1,1,1,0.333", schedule="budget")
    assert approx.round_plan().steps == (30, 30, 30, 9)
    res = unequal("budget", MIX_SPREAD)
    assert res["steps"] == [10, 10, 8, 5]
    assert res["tokens"] == [res["rounds_run"] * s * 8 * 64 for s in (10, 10, 8, 5)]


def test_wait_runs_fewer_rounds_than_budget_in_the_same_wall_time() -> None:
    wait, budget = unequal("wait"), unequal("budget")
    assert wait["wall"] == budget["wall"] == 30.0  # the preset's 3 rounds × H
    assert (wait["rounds_run"], budget["rounds_run"]) == (1, 3)  # rounds of 30 and 10 units
    assert wait["steps"] == [10, 10, 10, 10]
    assert [r for r, _ in budget["eval_loss_curve"]] == [0, 3]
    assert budget["config"]["rounds"] == 3  # so the learning-rate schedule spans them


def test_leave_out_excludes_exactly_the_slow(headers: list[tuple[int, str, int, int]]) -> None:
    res = unequal("leave_out", MIX_SPREAD)  # B = 25.0: workers of 10 and 20 units stay in
    assert res["steps"] == [10, 10, 0, 0]
    assert res["tokens"][2:] == [0, 0]
    assert res["round_wall"] == 20.0 and res["rounds_run"] == 1
    assert sorted((n, s) for _, n, s, _ in headers) == [("w000", 10), ("w001", 10)]


def test_payload_headers_carry_the_work(headers: list[tuple[int, str, int, int]]) -> None:
    res = unequal("budget")
    rounds = res["rounds_run"]
    assert len(headers) == 4 * rounds
    for w, steps in enumerate((10, 10, 10, 3)):
        mine = [(s, t) for _, n, s, t in headers if n == f"w{w:03d}"]
        assert mine == [(steps, steps * 8 * 64)] * rounds
    headers.clear()
    batch = unequal("batch")  # the slow worker: H steps of 2 rows, worth round(10·2/8) = 2
    assert batch["batch_rows"] == [8, 8, 8, 2]
    assert {(n, s, t) for _, n, s, t in headers if n == "w003"} == {("w003", 2, 10 * 2 * 64)}


def test_the_work_rule_reaches_the_aggregate() -> None:
    prints = {unequal("budget", work_weight=r)["final_fingerprint"] for r in ("mean", "steps")}
    assert len(prints) == 2


@pytest.mark.parametrize("schedule", ["wait", "leave_out", "budget", "batch"])
def test_equal_speeds_train_what_todays_run_trains(schedule: str) -> None:
    # Equal steps make every payload count once (peer_weights is None): bit for bit the run
    # without the model of time.
    tiny = {"algo": "sparseloco", "rounds": 2}
    plain = simulate(build_config("tiny", **tiny))
    same = simulate(build_config("tiny", speeds=[1, 1], schedule=schedule, **tiny))
    assert same["final_fingerprint"] == plain["final_fingerprint"]
    assert same["rounds_run"] == plain["rounds_run"] == 2
    assert same["tokens_per_worker"] == plain["tokens_per_worker"]


def test_unequal_options_are_checked() -> None:
    four = {"algo": "sparseloco", "workers": 4}
    with pytest.raises(ConfigError, match="--speeds has 3 values for 4 workers"):
        build_config("tiny", speeds="1,1,0.5", **four)
    with pytest.raises(ConfigError, match="--speeds: every value must be above 0, got 0"):
        build_config("tiny", speeds="1,1,0,1", **four)
    with pytest.raises(ConfigError, match=r"--speeds: .*got -1"):
        build_config("tiny", speeds=[1, 1, 1, -1], **four)
    with pytest.raises(ConfigError, match="--speeds: expected comma-separated numbers"):
        build_config("tiny", speeds="1,1,fast,1", **four)
    with pytest.raises(ConfigError, match="--link: every value must be 0 or more"):
        build_config("tiny", link="0,0,0,-5", **four)
    with pytest.raises(ConfigError, match="--link has 1 values"):
        build_config("tiny", link="5", **four)
    with pytest.raises(ConfigError, match="SparseLoCo only; drop them for --algo diloco"):
        build_config("tiny", algo="diloco", speeds="1,0.5")
    with pytest.raises(ConfigError, match="drop --overlap eager"):
        build_config("tiny", speeds="1,1,1,0.5", overlap="eager", **four)
    with pytest.raises(ConfigError, match="--budget"):
        build_config("tiny", speeds="1,1,1,0.5", budget="slowest", **four)
    with pytest.raises(ConfigError, match="leaves every worker out"):
        build_config("tiny", speeds="1,1,1,0.5", schedule="leave_out", budget="5", **four)
    assert main(["simulate", "--algo", "sparseloco", "--workers", "2", "--speeds", "1,0"]) == 2


def test_link_and_a_fixed_budget() -> None:
    # f = 10/v + t: (10, 10, 12, 30.03). A budget of 12 step units leaves worker 2 (2 units of
    # transfers) 10 units of training, 10 steps, and worker 3 floor(12 × 0.333) = 3 steps; the
    # round lasts as long as worker 2's 10 steps and transfers.
    cfg = build_config(
        "tiny",
        algo="sparseloco",
        workers=4,
        speeds="1,1,1,0.333",
        link="0,0,2,0",
        schedule="budget",
        budget="12",
        rounds=6,
    )
    plan = cfg.round_plan()
    assert plan.budget == 12.0 and plan.steps == (10, 10, 10, 3)
    assert plan.wall == 12.0
    assert cfg.wall == 60.0 and cfg.rounds == 5  # 6 rounds × H of wall time, rounds of 12
    assert cfg.timing.budget == 12.0


def test_unequal_flags_are_pinned() -> None:
    parser = build_parser()
    sub = next(
        a
        for a in parser._actions
        if isinstance(a, argparse._SubParsersAction) and a.dest == "command"
    )
    flags = {s for a in sub.choices["simulate"]._actions for s in a.option_strings}
    assert {"--speeds", "--link", "--schedule", "--wall", "--work-weight", "--budget"} <= flags


def test_bench_unequal_shares_runs_that_would_be_the_same(tmp_path: Path) -> None:
    from node.research.bench.unequal import run

    doc = run(
        preset="tiny",
        mixes="1,1,1,0.333",
        variants=["budget", "steps", "fastest"],
        final_only=True,
        out=tmp_path,
    )
    runs = doc["runs"]
    # steps is the default rule; the fastest worker's budget is the median's here (10 units).
    assert runs["1,1,1,0.333-steps"]["same_as"] == "budget"
    assert runs["1,1,1,0.333-fastest"]["same_as"] == "budget"
    assert sorted(p.name for p in tmp_path.glob("1_*.json")) == ["1_1_1_0.333-budget.json"]
    summary = (tmp_path / "summary.md").read_text()
    assert "(c) budget" in summary and "not run" in summary
