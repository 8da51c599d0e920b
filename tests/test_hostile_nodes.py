"""Hostile participants, as real node processes beside honest ones (SECURITY.md's harness).

Every scenario is a real run: SeaweedFS, ``python -m coordinator`` and four node
processes training the tiny model for 8 rounds, one of them hostile (``support.hostile``: the
daemon with its seams wrapped, run as ``python -m support.hostile_node``): it follows the
protocol but sends a payload meant to hurt. The members are joined in a fixed order before the
processes start, so every run gives the honest nodes the same data streams, and a run without
the attacker (3 honest nodes) is the yardstick.

Asserted from the outside (the coordinator's status): the honest nodes hold bit-identical
parameters after every round; an attack the screening recognises (sign flip, noise, huge
values on a tile or an entry) is screened out by every honest node in every round, with the
reason in their reports; and the honest nodes' final eval loss is within 1 % of the run
without the attacker (``LOSS_TOLERANCE``). A replay of a peer's payload and an update trained
from an old θ are not screened (they are not harmful), and must meet the same loss bound.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from node.cluster.seaweed import EmbeddedStore
from protocol.messages import RoundState
from protocol.runconfig import RunConfig, Timing
from protocol.status import StatusView
from support.cluster import Cluster

ROUNDS = 8
HONEST = ("node-0", "node-1", "node-2")
ATTACKER = "node-3"
LOSS_TOLERANCE = 0.01
SCREENED = ("sign_flip", "noise", "huge_tile", "one_entry")
HARMLESS = ("replay", "stale")
TIMING = Timing(first_round_s=120, min_round_s=60, max_round_s=120, heartbeat_timeout_s=30)


def _run(nodes: int) -> RunConfig:
    return RunConfig(
        name="hostile",
        model="tiny",
        rounds=ROUNDS,
        inner_steps=10,
        batch_size=8,
        min_nodes=nodes,
        checkpoint_every=0,
        timing=TIMING,
    )


def _join_in_order(cluster: Cluster, names: list[str]) -> None:
    """Join the members in a fixed order (so their data slots are fixed), before any process."""
    for name in names:
        req = urllib.request.Request(
            f"{cluster.url}/v1/join",
            data=json.dumps({"client": "test"}).encode(),
            headers={
                "Authorization": f"Bearer {cluster.tokens[name]}",
                "Content-Type": "application/json",
            },
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200


def run_scenario(
    root: Path, store: EmbeddedStore, attack: str | None, honest_only: bool
) -> StatusView:
    names = list(HONEST) if honest_only else [*HONEST, ATTACKER]
    label = attack or ("absent" if honest_only else "clean")
    cluster = Cluster(root / label, store, _run(len(names)), len(names), prefix=f"hostile-{label}")
    try:
        cluster.start_coordinator()
        _join_in_order(cluster, names)
        for name in names:
            cluster.start_node(name, attack=attack if name == ATTACKER else None)
        return cluster.wait_finished()
    finally:
        cluster.stop()


def honest_loss(status: StatusView) -> float:
    last = next(r for r in status.rounds if r.round == ROUNDS - 1)
    losses = {last.reports[n].eval_loss for n in HONEST}
    assert len(losses) == 1, losses  # bit-identical honest nodes evaluate identically
    loss = losses.pop()
    assert loss is not None
    return loss


def assert_honest_agree(status: StatusView) -> None:
    for summary in status.rounds:
        if summary.state == RoundState.CLOSED:
            fps = {summary.fingerprints[n] for n in HONEST}
            assert len(fps) == 1, (summary.round, summary.fingerprints)


@pytest.fixture(scope="module")
def absent(tmp_path_factory: pytest.TempPathFactory, store: EmbeddedStore) -> float:
    """The honest nodes' final loss without the attacker: the yardstick."""
    status = run_scenario(tmp_path_factory.mktemp("absent"), store, None, honest_only=True)
    assert_honest_agree(status)
    return honest_loss(status)


def test_a_clean_run_screens_nobody(tmp_path: Path, store: EmbeddedStore, absent: float) -> None:
    status = run_scenario(tmp_path, store, None, honest_only=False)
    for summary in status.rounds:
        for report in summary.reports.values():
            assert not any(r.startswith("screened") for r in report.rejected.values()), report
    print(f"clean: {honest_loss(status):.4f} (absent {absent:.4f})")


@pytest.mark.parametrize("attack", SCREENED)
def test_a_hostile_update_is_screened_out_every_round(
    attack: str, tmp_path: Path, store: EmbeddedStore, absent: float
) -> None:
    status = run_scenario(tmp_path, store, attack, honest_only=False)
    assert_honest_agree(status)
    for summary in status.rounds:
        if summary.state != RoundState.CLOSED:
            continue
        assert ATTACKER in summary.gather  # well formed and on time: the coordinator gathers it
        for node in HONEST:
            reason = summary.reports[node].rejected.get(ATTACKER, "")
            assert reason.startswith("screened: sign agreement"), (summary.round, node, reason)
    loss = honest_loss(status)
    print(f"{attack}: {loss:.4f} (absent {absent:.4f})")
    assert loss <= absent * (1 + LOSS_TOLERANCE)


@pytest.mark.parametrize("attack", HARMLESS)
def test_a_copied_or_stale_update_hurts_less_than_the_bound(
    attack: str, tmp_path: Path, store: EmbeddedStore, absent: float
) -> None:
    status = run_scenario(tmp_path, store, attack, honest_only=False)
    assert_honest_agree(status)
    loss = honest_loss(status)
    print(f"{attack}: {loss:.4f} (absent {absent:.4f})")
    assert loss <= absent * (1 + LOSS_TOLERANCE)
