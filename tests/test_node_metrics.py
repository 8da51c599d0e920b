"""The nodes' metrics: pushed with every round report, served per node on ``/metrics``.

Real coordinator app (aiohttp test client) and the session's SeaweedFS store, as in the other
coordinator API tests. A node's report carries losses, timings, bytes and retries; the
coordinator's ``/metrics`` shows them per node, counts a replayed report once, and rebuilds
every series from the database after a restart. A node whose token is revoked (by the token
command's own connection to the database, as ``sparseloco coordinator token revoke`` does) loses
its live figures, there and after a restart; its run counters stay.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from coordinator.ops import admin
from coordinator.rules.tokens import TokenTable
from coordinator.state.db import Database
from coordinator.state.schema import DB_FILE
from protocol.runconfig import RunConfig
from support.api import FP_A, ApiFactory

pytestmark = pytest.mark.asyncio

REPORT = {
    "fingerprint": FP_A,
    "train_loss": 4.25,
    "eval_loss": 4.5,
    "bytes_up": 3000,
    "bytes_down": 6000,
    "timings": {"train": 2.0, "upload": 0.5, "download": 0.25, "eval": 0.1},
    "retries": 3,
    "tokens_per_s": 51200.0,
    "mfu": 0.375,
}


async def test_reports_become_per_node_series_that_survive_a_restart(
    make_api: ApiFactory,
) -> None:
    run = RunConfig(name="node-metrics", rounds=3, inner_steps=10, min_nodes=1)
    api = await make_api(run, prefix="node-metrics")
    await api.call("POST", "/v1/join", "n0", {})
    await api.contribute("n0", 0, FP_A)
    assert (await api.manifest("n0", 0))[0] == 200
    for _ in range(2):  # a replayed report (after a resync) is the same history: counted once
        status, _ = await api.call("POST", "/v1/rounds/0/report", "n0", REPORT)
        assert status == 200
    lines = (await api.call("GET", "/metrics", None))[1]
    expected = (
        'sparseloco_node_train_loss{node="n0"} 4.25',
        'sparseloco_node_eval_loss{node="n0"} 4.5',
        'sparseloco_node_step_seconds{node="n0"} 0.2',
        'sparseloco_node_phase_seconds{node="n0",phase="upload"} 0.5',
        'sparseloco_node_transfer_bytes_per_second{direction="up",node="n0"} 6000.0',
        'sparseloco_node_transfer_bytes_per_second{direction="down",node="n0"} 24000.0',
        'sparseloco_node_bytes_total{direction="up",node="n0"} 3000.0',
        'sparseloco_node_retries_total{node="n0"} 3.0',
        'sparseloco_node_last_round{node="n0"} 0.0',
        'sparseloco_node_tokens_per_second{node="n0"} 51200.0',
        'sparseloco_node_mfu{node="n0"} 0.375',
    )
    for line in expected:
        assert line in lines, line

    again = await make_api(run, prefix="node-metrics")  # the same state directory
    restarted = (await again.call("GET", "/metrics", None))[1]
    for line in expected:
        assert line in restarted, line


#: Safety net for the ticker to apply a revocation (it looks every quarter second).
APPLIED_S = 30.0


async def test_a_revoked_node_loses_its_live_figures(make_api: ApiFactory, tmp_path: Path) -> None:
    run = RunConfig(name="node-metrics-revoked", rounds=3, inner_steps=10, min_nodes=2)
    api = await make_api(run, prefix="node-metrics-revoked")
    for node in ("n0", "n1"):
        await api.call("POST", "/v1/join", node, {})
    for node in ("n0", "n1"):
        await api.contribute(node, 0, FP_A)
    assert (await api.manifest("n0", 0))[0] == 200
    for node in ("n0", "n1"):
        assert (await api.call("POST", "/v1/rounds/0/report", node, REPORT))[0] == 200
    lines = (await api.call("GET", "/metrics", None))[1]
    assert 'sparseloco_node_tokens_per_second{node="n1"} 51200.0' in lines

    cli = Database(tmp_path / "state" / DB_FILE)  # as `sparseloco coordinator token revoke n1`
    try:
        assert admin.revoke(TokenTable(cli), "n1", now=0.0) == 1
    finally:
        cli.close()
    async with asyncio.timeout(APPLIED_S):
        while 'node="n1"} 51200.0' in (lines := (await api.call("GET", "/metrics", None))[1]):
            await asyncio.sleep(0.05)

    def live_of(text: str, node: str) -> list[str]:
        """The node's gauge lines (its counters end in ``_total``/``_created``)."""
        return [
            line
            for line in text.splitlines()
            if f'node="{node}"' in line and "_total{" not in line and "_created{" not in line
        ]

    assert live_of(lines, "n1") == []
    assert len(live_of(lines, "n0")) >= 10  # the other node keeps all of its own
    assert 'sparseloco_node_bytes_total{direction="up",node="n1"} 3000.0' in lines  # history
    assert 'sparseloco_members{state="revoked"} 1.0' in lines

    again = await make_api(run, prefix="node-metrics-revoked")  # restarted on its state
    restarted = (await again.call("GET", "/metrics", None))[1]
    assert live_of(restarted, "n1") == [] and len(live_of(restarted, "n0")) >= 10


async def test_the_work_of_unequal_rounds_is_on_metrics(make_api: ApiFactory) -> None:
    """A round cut short: its steps and tokens, the k it sent and what cut it per node, the
    step time per step taken, and each node's share of the round's work (from the manifest)."""
    run = RunConfig(name="work-metrics", rounds=3, inner_steps=10, min_nodes=2)
    api = await make_api(run, prefix="work-metrics")
    for node in ("n0", "n1"):
        await api.call("POST", "/v1/join", node, {})
    for node, steps in (("n0", 10), ("n1", 4)):
        body = f"payload {node}".encode()
        assert await api.put_payload(node, 0, body, claimed=body) == 200
        req = {
            "size": len(body),
            "sha256": hashlib.sha256(body).hexdigest(),
            "base_fingerprint": FP_A,
            "steps": steps,
            "tokens": steps * 512,
        }
        status, _ = await api.call("POST", "/v1/rounds/0/submit", node, req)
        assert status == 200
    assert (await api.manifest("n0", 0))[0] == 200
    cut = {**REPORT, "steps": 4, "tokens": 2048, "cut": "link", "topk": 16}
    assert (await api.call("POST", "/v1/rounds/0/report", "n1", cut))[0] == 200
    lines = (await api.call("GET", "/metrics", None))[1]
    for line in (
        'sparseloco_node_steps{node="n1"} 4.0',
        'sparseloco_node_tokens{node="n1"} 2048.0',
        'sparseloco_node_topk{node="n1"} 16.0',
        'sparseloco_node_cut_rounds_total{by="link",node="n1"} 1.0',
        'sparseloco_node_step_seconds{node="n1"} 0.5',  # 2 s of training over 4 steps
        f'sparseloco_node_work_share{{node="n0"}} {10 / 14}',
        f'sparseloco_node_work_share{{node="n1"}} {4 / 14}',
    ):
        assert line in lines, line
