"""``sparseloco simulate`` end to end on the tiny preset, through the real console script."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from node.cli import build_parser, main
from node.research.simulate import build_config, simulate
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
