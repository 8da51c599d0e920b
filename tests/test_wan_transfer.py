"""A large payload over the flaky link: uploaded in parts, downloaded in resumed ranges, intact.

The WAN lab (``node.research.wan``): SeaweedFS and ``python -m coordinator`` in the server
namespace, one node process (``support.wan_transfer``) behind ``flaky``: 20 Mbit/s up, 100
down, 40 ms, and a relay that resets one live TCP connection every ``RESET_S`` on average
(uniformly 0.5-1.5 times that apart). The node uploads a synthetic payload of ``SIZE`` bytes
as its round's payload through the coordinator's grant (a multipart upload: 8 MiB parts, four
in flight), has it completed, submits, and downloads it back twice (into memory, into a file),
as every peer of a round does.

The upload takes about 40 s and the two downloads about 11 s at these rates, so resets land
in both phases: the relay never lets 1.5 ``RESET_S`` pass without one. Verdicts are
counts and bytes, not times: the payload arrives intact both ways and the submit is accepted;
the relay reset connections; upload parts were sent again (a part cut mid-body fails alone,
the others go on) and downloaded ranges were resumed from the byte they had reached
(``TransferCounts``). The timings and counts are printed (``-s``). Skipped with the lab's
reason where network namespaces cannot be made (not root); CI runs as root.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from node.cluster.seaweed import EmbeddedStore
from node.daemon.multipart import MULTIPART_THRESHOLD, UPLOAD_PART_SIZE
from node.research.wan.lab import WanLab
from node.research.wan.profiles import PROFILES
from protocol.runconfig import RunConfig, Timing
from support.cluster import Cluster

pytestmark = pytest.mark.skipif(
    WanLab.available() is not None, reason=f"WAN lab unavailable: {WanLab.available()}"
)

#: The synthetic payload: the smallest that goes in parts (64 MiB, eight parts of 8 MiB: four
#: in flight and more waiting).
SIZE = MULTIPART_THRESHOLD
#: Mean seconds between the flaky link's resets (the profile's minute, shortened): at most
#: 7.5 s apart, shorter than the two downloads together, so resets land in both phases.
RESET_S = 5.0
#: Safety net for the node process (a healthy transfer takes about a minute).
NODE_TIMEOUT_S = 900
ROOT = Path(__file__).resolve().parents[1]


def test_a_large_payload_crosses_the_flaky_link_intact(tmp_path: Path) -> None:
    run = RunConfig(
        name="wanxfer",
        min_nodes=1,
        rounds=2,
        checkpoint_every=0,
        # The node sends no heartbeats while it transfers: it must stay a member anyway.
        timing=Timing(
            first_round_s=NODE_TIMEOUT_S,
            min_round_s=60,
            max_round_s=NODE_TIMEOUT_S,
            heartbeat_timeout_s=NODE_TIMEOUT_S,
        ),
    )
    out = tmp_path / "result.json"
    folder = tmp_path / "node"
    folder.mkdir()
    with WanLab(tmp_path / "lab") as lab, lab.entered():
        store = EmbeddedStore(tmp_path / "store", host=lab.service_ip, bind="0.0.0.0")
        store.start()
        cluster = Cluster(tmp_path / "run", store, run, 1, public_host=lab.service_ip)
        try:
            cluster.start_coordinator()
            assert store.s3_port is not None
            lab.expose(store.s3_port, cluster.port)
            host = lab.add_node("flaky", PROFILES["flaky"].with_reset(RESET_S))
            env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
            argv = [sys.executable, "-m", "support.wan_transfer", cluster.url]
            argv += [cluster.tokens["node-0"], str(SIZE), "7", str(out), str(folder)]
            t0 = time.monotonic()
            with open(tmp_path / "node.log", "wb") as log:
                node = host.popen(argv, env=env, cwd=ROOT, stdout=log, stderr=log)
                code = node.wait(timeout=NODE_TIMEOUT_S)
            wall = time.monotonic() - t0
            resets = lab.resets("flaky")
        finally:
            cluster.stop()
            store.stop()
    assert code == 0, (tmp_path / "node.log").read_text()[-3000:]
    result = json.loads(out.read_text())
    up, down = result["after_upload"], result["after_download"]
    print(
        f"\nwan_transfer size_mib={SIZE >> 20} parts={result['parts']} wall_s={wall:.1f}"
        f" upload_s={result['upload_s']:.1f} download_memory_s={result['download_memory_s']:.1f}"
        f" download_file_s={result['download_file_s']:.1f} relay_resets={resets}"
        f" retried_parts={up['retried_parts']}"
        f" resumed_ranges={down['resumed_ranges'] - up['resumed_ranges']}"
        f" bytes_kept={down['bytes_kept'] - up['bytes_kept']}"
    )
    assert result["accepted"] and result["memory_intact"] and result["file_intact"]
    assert result["parts"] == SIZE // UPLOAD_PART_SIZE
    assert resets >= 3, f"the flaky link reset only {resets} times; the test shows nothing"
    assert up["retried_parts"] >= 1, "no reset cut an upload part"
    assert down["resumed_ranges"] - up["resumed_ranges"] >= 1, "no download was resumed"
