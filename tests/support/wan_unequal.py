"""One run in the WAN lab with one node behind a thin uplink, for the test and benchmark 19.

Four nodes of the ``base`` model (10.8 M parameters, H = 8, batches of 2): three behind
``office`` links (100 Mbit/s each way, 20 ms), and node-3 behind ``thin`` (an uplink of
``THIN_UP_MBIT``, 100 Mbit/s down, 40 ms): slow enough that its whole payload's upload (about
200 kB) takes at least as long as the others' inner steps. (The model is ``base`` because the
lab's token bucket lets 64 KiB through at once, for the veths' segmentation offload: a smaller
model's whole payload would cross a thin link in one burst.) ``run(..., thin=False)`` is the
same run with node-3 on ``office`` too: the baseline its training shares are compared with.
Returns the coordinator's final status and, per node, the share of the steady rounds' wall
time it spent training (rounds 1 to the one before last).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from node.cluster.seaweed import EmbeddedStore
from node.research.bench.straggler import status_shares
from node.research.wan.lab import WanLab
from node.research.wan.profiles import PROFILES, LinkProfile
from protocol.runconfig import RunConfig, Timing
from protocol.status import StatusView
from support.cluster import Cluster

ROUNDS = 8
H = 8
#: node-3's uplink: about 30 s for the base model's 200 kB payload (past the first 64 KiB),
#: longer than the others' inner steps take on this machine (5-15 s).
THIN_UP_MBIT = 0.03
THIN = LinkProfile("thin", up_mbit=THIN_UP_MBIT, down_mbit=100, rtt_ms=40)
SLOW = "node-3"


def links(thin: bool) -> dict[str, LinkProfile]:
    office = PROFILES["office"]
    return {f"node-{i}": office for i in range(3)} | {SLOW: THIN if thin else office}


def shares(status: StatusView) -> dict[str, float]:
    """Per node: its share of the steady rounds' wall time spent training (1 to the one before
    last)."""
    return status_shares(status, range(1, ROUNDS - 1))


def run(root: Path, *, thin: bool) -> dict[str, Any]:
    """The run; ``{"status": StatusView, "shares": {...}, "wall_s": ...}``."""
    config = RunConfig(
        name="wan-thin" if thin else "wan-even",
        model="base",
        rounds=ROUNDS,
        inner_steps=H,
        batch_size=2,
        min_nodes=4,
        checkpoint_every=0,
        eval_every=100,
        timing=Timing(first_round_s=240, heartbeat_timeout_s=60),
    )
    t0 = time.monotonic()
    with WanLab(root / "lab") as lab, lab.entered():
        store = EmbeddedStore(root / "store", host=lab.service_ip, bind="0.0.0.0")
        store.start()
        cluster = Cluster(root / "run", store, config, 4, public_host=lab.service_ip, wait_s=900.0)
        try:
            cluster.start_coordinator()
            assert store.s3_port is not None
            lab.expose(store.s3_port, cluster.port)
            for i, (name, profile) in enumerate(links(thin).items()):
                host = lab.add_node(name, profile, seed=i)
                with host.entered():
                    cluster.start_node(name)
            status = cluster.wait_finished()
        finally:
            cluster.stop()
            store.stop()
    return {"status": status, "shares": shares(status), "wall_s": time.monotonic() - t0}
