"""A scenario and its fault-free baseline, run and judged: what the chaos tests call.

``run_scenario`` runs one scenario (``runner.ScenarioRunner``) on the session's store, or on a
store of its own when the scenario stops the store. ``chaos_test`` runs the baseline first, or
beside the scenario in a thread of its own when the scenario asks for it
(``Scenario.baseline_beside``), compares their losses, writes the results and fails with every
invariant broken.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from node.cluster.seaweed import EmbeddedStore

from .results import compare_to_baseline, write_results
from .runner import ScenarioRunner
from .scenario import Scenario


def run_scenario(scenario: Scenario, tmp_path: Path, store: EmbeddedStore) -> dict[str, Any]:
    """Run ``scenario`` (on its own store if it stops the store) and return its result."""
    root = tmp_path / scenario.name
    if not scenario.needs_own_store:
        return ScenarioRunner(scenario, root, store).run()
    own = EmbeddedStore(tmp_path / f"{scenario.name}-store")
    own.start()
    try:
        return ScenarioRunner(scenario, root, own).run()
    finally:
        own.stop()


def _beside(
    scenario: Scenario, tmp_path: Path, store: EmbeddedStore
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The baseline in a thread while the scenario runs in this one: (baseline, result)."""
    plain = scenario.baseline()
    # Built here, before the thread starts: boto3 must not make two clients at once.
    runner = ScenarioRunner(plain, tmp_path / plain.name, store)
    with ThreadPoolExecutor(1, thread_name_prefix="chaos-baseline") as pool:
        baseline = pool.submit(runner.run)
        try:
            result = run_scenario(scenario, tmp_path, store)
        except BaseException:
            runner.abandoned.set()  # Ctrl-C or a failure: stop the baseline's processes too
            raise
        return baseline.result(), result


def chaos_test(scenario: Scenario, tmp_path: Path, store: EmbeddedStore) -> dict[str, Any]:
    """Baseline and scenario (one after the other, or side by side if the scenario says so);
    write the results; fail with every invariant broken."""
    if scenario.baseline_beside:
        baseline, result = _beside(scenario, tmp_path, store)
    else:
        baseline = run_scenario(scenario.baseline(), tmp_path, store)
        result = run_scenario(scenario, tmp_path, store)
    compare_to_baseline(result, baseline, scenario.loss_tolerance)
    path = write_results(result, tmp_path)
    problems = list(result["failures"]) + [f"baseline: {f}" for f in baseline["failures"]]
    if problems:
        raise AssertionError(
            f"{len(problems)} invariant failures in {scenario.name} (results: {path}):\n"
            + "\n".join(problems)
        )
    return result
