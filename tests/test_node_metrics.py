"""The nodes' metrics: pushed with every round report, served per node on ``/metrics``.

Real coordinator app (aiohttp test client) and the session's SeaweedFS store, as in the other
coordinator API tests. A node's report carries losses, timings, bytes and retries; the
coordinator's ``/metrics`` shows them per node, counts a replayed report once, and rebuilds
every series from the database after a restart.
"""

from __future__ import annotations

import pytest

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
