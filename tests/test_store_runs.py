"""Whole runs on the stores that keep fewer promises than SeaweedFS: real processes throughout.

- moto's server (a second S3 implementation), the operator having accepted that it binds no
  bytes to a URL (``storage.accept_unbound_uploads``), and MiniStack (a third, which binds
  them): a coordinator and two nodes, node-1's payloads going to the store as multipart uploads
  (``support.parts_node``: its threshold lowered below a payload's size), every round closed
  with both, the same θ everywhere;
- SeaweedFS behind a proxy that lets a second write replace the first (a store that ignores
  ``If-None-Match``, ``support.s3proxy``): the coordinator finds that out at start, says so,
  names every payload's key by its sha256, and the nodes end every round with the same θ.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from node.cluster.seaweed import EmbeddedStore
from protocol.messages import RoundState
from protocol.runconfig import RunConfig
from protocol.status import StatusView
from support.cluster import Cluster
from support.s3proxy import S3Proxy
from support.s3servers import ServerStore

ROUNDS = 4
DIGEST_KEY = re.compile(r"/payloads/node-\d\.([0-9a-f]{64})\.slc$")


def _run(name: str) -> RunConfig:
    return RunConfig(name=name, rounds=ROUNDS, min_nodes=2, gather_size=2, checkpoint_every=2)


def _agreed(cluster: Cluster, status: StatusView) -> None:
    """Every round closed with both nodes, and both applied the same θ after each."""
    closed = [r for r in status.rounds if r.state == RoundState.CLOSED]
    assert sorted(r.round for r in closed) == list(range(ROUNDS))
    for r in closed:
        assert sorted(r.gather) == ["node-0", "node-1"], (r.round, r.gather, r.excluded)
        assert len(set(r.fingerprints.values())) == 1, (r.round, r.fingerprints)
    applied = [cluster.applied_fingerprints(n) for n in ("node-0", "node-1")]
    assert applied[0] and applied[0] == applied[1]


def _coordinator_log(cluster: Cluster) -> str:
    return "".join(p.read_text() for p in sorted((cluster.root / "logs").glob("coordinator-*")))


@pytest.mark.parametrize("server", ["moto", "ministack"])
def test_a_run_on_another_s3_server_with_payloads_in_parts(
    tmp_path: Path, server: str, request: pytest.FixtureRequest
) -> None:
    """moto binds nothing: the run needs the risk accepted (and the log says so); MiniStack
    binds the bytes and needs nothing."""
    other: ServerStore = request.getfixturevalue(server)
    storage = {"accept_unbound_uploads": True} if server == "moto" else {}
    cluster = Cluster(tmp_path / "run", other, _run(server), 2, storage=storage)
    try:
        cluster.start_coordinator()
        cluster.start_node("node-0")
        cluster.start_wrapped_node("node-1", "support.parts_node", "1")
        status = cluster.wait_finished()
    finally:
        cluster.stop()
    _agreed(cluster, status)
    log = _coordinator_log(cluster)
    assert ("RISK ACCEPTED" in log) is (server == "moto")
    completed = re.findall(r"event=upload_completed round=(\d+) node=node-1 parts=1", log)
    assert sorted(int(r) for r in completed) == list(range(ROUNDS)), completed


def test_a_run_on_a_store_that_ignores_if_none_match(tmp_path: Path, store: EmbeddedStore) -> None:
    proxy = S3Proxy(store.endpoint, "overwrite")
    proxy.start()
    # A prefix of its own: the session's store holds other tests' runs too.
    cluster = Cluster(tmp_path / "run", proxy, _run("naming"), 2, prefix=f"naming-{tmp_path.name}")
    try:
        cluster.start_coordinator()
        for name in cluster.tokens:
            cluster.start_node(name)
        status = cluster.wait_finished()
    finally:
        cluster.stop()
        proxy.stop()
    _agreed(cluster, status)
    log = _coordinator_log(cluster)
    assert "event=store_fallback" in log and "write-once by naming" in log
    # Every manifest names each payload by a key that carries its sha256.
    client: Any = store.client()
    bucket = store.endpoint.bucket
    listed = client.list_objects_v2(Bucket=bucket, Prefix=f"{cluster.prefix}/").get("Contents")
    manifests = [o["Key"] for o in listed or [] if o["Key"].endswith("/manifest.json")]
    assert len(manifests) == ROUNDS, manifests
    for key in manifests:
        signed = json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())
        for entry in signed["manifest"]["gather"]:
            named = DIGEST_KEY.search(entry["key"])
            assert named and named.group(1) == entry["sha256"], entry
