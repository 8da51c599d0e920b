"""Checkpoints and retention through the coordinator's HTTP API, against the real store.

Nodes run small rounds (presigned uploads, submits, reports) in-process through ``make_api``
(``tests/support/api.py``), as in ``test_coordinator_api.py``; checkpoint files go to SeaweedFS
through the grants exactly as a node sends them, and what the coordinator writes or deletes is
checked by listing the bucket. Checkpoint files are real safetensors files of one θ
(``support.theta_files``): the coordinator verifies what it commits, streaming the object back
in chunks (``coordinator.store.verify``), which one test drives directly with chunks far smaller
than the file.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import ClientSession
from yarl import URL

from coordinator.base.errors import BadCheckpoint, Conflict
from coordinator.state.db import Database
from coordinator.state.schema import DB_FILE
from coordinator.store.retention import payload_rounds
from coordinator.store.storage import S3Store
from coordinator.store.verify import CheckpointVerifier
from node.cluster.seaweed import EmbeddedStore
from protocol.fingerprint import fingerprint
from protocol.keys import checkpoint_key, latest_checkpoint_key, run_prefix
from protocol.messages import CheckpointInfo, CheckpointUpload
from protocol.reports import RoundReport
from protocol.runconfig import RunConfig, Timing
from support.api import FP_B, Api, ApiFactory
from support.theta_files import THETA_FP, offer, theta_file

F = THETA_FP
NODES = ("n0", "n1")
#: Long deadlines and heartbeats: tests that move the clock must not time anything else out.
CALM = Timing(first_round_s=3600, min_round_s=3600, max_round_s=7200, heartbeat_timeout_s=100000)


class Clock:
    """Wall time plus an offset the test can move forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


def run_config(**kw: Any) -> RunConfig:
    return RunConfig(name="ckpt", min_nodes=2, rounds=20, checkpoint_every=2, timing=CALM, **kw)


async def play_round(api: Api, round_: int, report: dict[str, Any] | None = None) -> None:
    """Both nodes contribute to ``round_``, it closes, both report fingerprint F."""
    for node in NODES:
        assert (await api.contribute(node, round_, F))["accepted"]
    assert (await api.manifest("n0", round_))[0] == 200
    for node in NODES:
        body = report or {"fingerprint": F}
        status, ack = await api.call("POST", f"/v1/rounds/{round_}/report", node, body)
        assert status == 200, ack


async def put(url: str, headers: dict[str, str], body: bytes) -> int:
    async with (
        ClientSession() as http,
        http.put(URL(url, encoded=True), data=body, headers=headers) as r,
    ):
        return r.status


async def checkpoint(api: Api, node: str, round_: int, body: bytes) -> dict[str, Any]:
    """Upload ``body`` as θ_round through a grant and commit it: the CheckpointInfo."""
    status, grant = await api.call("POST", f"/v1/checkpoints/{round_}/upload", node, offer(body))
    assert status == 200, grant
    assert await put(grant["url"], grant["headers"], body) == 200
    status, info = await api.call("POST", f"/v1/checkpoints/{round_}/commit", node, offer(body))
    assert status == 200, info
    return dict(info)


async def join_all(api: Api) -> None:
    for node in NODES:
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200


def get_json(s3: Any, bucket: str, key: str) -> dict[str, Any]:
    return CheckpointInfo.model_validate_json(
        s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    ).model_dump(mode="json")


@pytest.mark.asyncio
async def test_grant_commit_and_latest(make_api: ApiFactory, s3: Any) -> None:
    api = await make_api(run_config(), max_checkpoint_bytes=4096)
    await join_all(api)
    mass = {"computed": 1.5, "sent": 1.0, "held": 0.5, "scale": 3.0}
    await play_round(api, 0, {"fingerprint": F, "mass": mass, "train_loss": 2.5})
    await play_round(api, 1)
    run_id, bucket = api.config.run.run_id, api.config.storage.bucket
    body = theta_file("theta_2")

    status, err = await api.call("GET", "/v1/checkpoints/latest", "n1")
    assert (status, err["error"]) == (404, "no_checkpoint")
    status, grant = await api.call("POST", "/v1/checkpoints/2/upload", "n0", offer(body))
    assert status == 200, grant
    assert grant["key"] == checkpoint_key(api.config.storage.prefix, run_id, 2)
    assert grant["headers"]["If-None-Match"] == "*"
    status, err = await api.call("POST", "/v1/checkpoints/2/upload", "n1", offer(body))
    assert (status, err["error"]) == (409, "not_needed")  # n0 holds the grant
    status, err = await api.call("POST", "/v1/checkpoints/2/upload", "n0", offer(body, FP_B))
    assert (status, err["error"]) == (409, "wrong_fingerprint")
    for r, code in ((0, "not_needed"), (1, "not_needed"), (3, "unknown_round")):
        status, err = await api.call("POST", f"/v1/checkpoints/{r}/upload", "n0", offer(body))
        assert err["error"] == code, (r, err)
    status, err = await api.call("POST", "/v1/checkpoints/2/upload", "n0", offer(b"x" * 5000))
    assert (status, err["error"], err["field"]) == (413, "too_large", "size")
    status, again = await api.call("POST", "/v1/checkpoints/2/upload", "n0", offer(body))
    assert status == 200 and again["key"] == grant["key"]  # the holder asks again: renewed

    status, err = await api.call("POST", "/v1/checkpoints/2/commit", "n0", offer(body))
    assert (status, err["error"]) == (409, "missing")  # nothing uploaded yet
    assert await put(again["url"], again["headers"], b"X" * len(body)) in (400, 403)
    assert await put(again["url"], again["headers"], body) == 200
    status, err = await api.call("POST", "/v1/checkpoints/2/commit", "n1", offer(body))
    assert (status, err["error"]) == (409, "not_granted")
    status, info = await api.call("POST", "/v1/checkpoints/2/commit", "n0", offer(body))
    assert status == 200, info
    assert info["round"] == 2 and info["fingerprint"] == F and info["node_id"] == "n0"
    assert info["sha256"] == hashlib.sha256(body).hexdigest() and info["size"] == len(body)
    assert await api.call("POST", "/v1/checkpoints/2/commit", "n0", offer(body)) == (200, info)
    status, err = await api.call("POST", "/v1/checkpoints/2/upload", "n1", offer(body))
    assert (status, err["error"]) == (409, "not_needed")  # committed

    prefix = api.config.storage.prefix
    assert get_json(s3, bucket, latest_checkpoint_key(prefix, run_id)) == info
    sidecar = info["key"].removesuffix(".safetensors") + ".json"
    assert get_json(s3, bucket, sidecar) == info
    status, view = await api.call("GET", "/v1/checkpoints/latest", "n1")
    assert status == 200 and view["info"] == info
    async with ClientSession() as http, http.get(URL(view["url"], encoded=True)) as resp:
        assert await resp.read() == body
    status, st = await api.call("GET", "/v1/status", None)
    assert st["checkpoint"] == info
    assert RoundReport.model_validate(st["rounds"][0]["reports"]["n0"]).mass is not None
    assert st["rounds"][0]["reports"]["n0"]["mass"] == mass
    status, text = await api.call("GET", "/metrics", None)
    assert "sparseloco_checkpoints_committed_total 1.0" in text


@pytest.mark.asyncio
async def test_expired_grant_passes_to_another_node(make_api: ApiFactory) -> None:
    clock = Clock()
    api = await make_api(run_config(), clock=clock)
    await join_all(api)
    await play_round(api, 0)
    await play_round(api, 1)
    mine, theirs = theta_file("n0's file"), theta_file("n1's file")
    status, grant = await api.call("POST", "/v1/checkpoints/2/upload", "n0", offer(mine))
    assert await put(grant["url"], grant["headers"], mine) == 200
    clock.offset += api.config.server.presign_expiry_s + 1  # n0 vanished before committing
    # n1 offers other bytes: the leftover object is deleted so n1's write-once PUT can land.
    status, grant = await api.call("POST", "/v1/checkpoints/2/upload", "n1", offer(theirs))
    assert status == 200, grant
    assert await put(grant["url"], grant["headers"], theirs) == 200
    status, err = await api.call("POST", "/v1/checkpoints/2/commit", "n0", offer(mine))
    assert (status, err["error"]) == (409, "not_granted")
    status, info = await api.call("POST", "/v1/checkpoints/2/commit", "n1", offer(theirs))
    assert status == 200 and info["node_id"] == "n1"

    # Identical bytes left behind (θ is bit-identical on every node): kept, and committable.
    await play_round(api, 2)
    await play_round(api, 3)
    same = theta_file("theta_4")
    status, grant = await api.call("POST", "/v1/checkpoints/4/upload", "n0", offer(same))
    assert await put(grant["url"], grant["headers"], same) == 200
    clock.offset += api.config.server.presign_expiry_s + 1
    status, grant = await api.call("POST", "/v1/checkpoints/4/upload", "n1", offer(same))
    assert await put(grant["url"], grant["headers"], same) == 412  # already there
    status, info = await api.call("POST", "/v1/checkpoints/4/commit", "n1", offer(same))
    assert status == 200 and info["round"] == 4


def test_payload_rounds_rule() -> None:
    assert list(payload_rounds(-1, None, 50, 3)) == []  # no checkpoint: joiners need θ_0 on
    assert list(payload_rounds(-1, 8, 10, 3)) == list(range(7))
    assert list(payload_rounds(-1, 4, 10, 3)) == list(range(4))
    assert list(payload_rounds(3, 4, 10, 3)) == []
    assert list(payload_rounds(3, 8, 30, 3)) == [4, 5, 6, 7]


async def wait_until(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll a condition on the state the background task writes (it has no per-pass signal)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def keys(s3: Any, bucket: str, prefix: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {obj["Key"][len(prefix) :] for page in pages for obj in page.get("Contents", [])}


@pytest.mark.asyncio
async def test_retention_and_restart(make_api: ApiFactory, s3: Any, tmp_path: Path) -> None:
    run = run_config(retention_rounds=3, keep_checkpoints=2)
    prefix = f"ckpt-{uuid.uuid4().hex[:8]}"
    api = await make_api(run, prefix=prefix)
    await join_all(api)
    infos: dict[int, dict[str, Any]] = {}
    for r in range(10):
        if r and r % 2 == 0:
            infos[r] = await checkpoint(api, "n0", r, theta_file(f"theta {r}"))
        await play_round(api, r)
    # Round 10 is current; the checkpoints kept are 8 and 6: payloads of rounds < min(6, 10 - 3)
    # go (a node that cannot use 8 falls back to 6 and replays from there).
    db = api.coord.machine.db
    await wait_until(lambda: db.get_meta("pruned_through") == "5")
    await wait_until(lambda: sum(not c.pruned for c in db.checkpoints()) == 2)
    bucket, root = api.config.storage.bucket, run_prefix(prefix, run.run_id)
    stored = keys(s3, bucket, root)
    for r in range(10):
        manifest = f"rounds/{r:08d}/manifest.json"
        payloads = {f"rounds/{r:08d}/payloads/{n}.slc" for n in NODES}
        assert manifest in stored
        assert (payloads <= stored) == (r >= 6), r
        assert not (payloads & stored) or r >= 6, r
    for r in (2, 4, 6, 8):
        ckpt = {f"checkpoints/{r:08d}/model.safetensors", f"checkpoints/{r:08d}/model.json"}
        assert (ckpt <= stored) == (r >= 6) and (not (ckpt & stored) or r >= 6), r
    assert get_json(s3, bucket, root + "checkpoints/latest.json") == infos[8]
    status, text = await api.call("GET", "/metrics", None)
    assert 'sparseloco_objects_deleted_total{kind="payload"} 12.0' in text
    assert 'sparseloco_objects_deleted_total{kind="checkpoint"} 4.0' in text
    await api.client.close()

    # As if latest.json and the sidecar of 8 had never been written before a crash.
    crashed = Database(tmp_path / "state" / DB_FILE)
    with crashed.tx():
        crashed.set_meta("latest_published", "6")
        crashed._conn.execute("UPDATE checkpoints SET published=0 WHERE round=8")
    crashed.close()
    s3.delete_object(Bucket=bucket, Key=root + "checkpoints/latest.json")
    s3.delete_object(Bucket=bucket, Key=root + "checkpoints/00000008/model.json")

    api = await make_api(run, prefix=prefix)
    await asyncio.wait_for(api.coord.publisher.published.wait(), 20)
    assert get_json(s3, bucket, root + "checkpoints/latest.json") == infos[8]
    assert get_json(s3, bucket, root + "checkpoints/00000008/model.json") == infos[8]
    status, view = await api.call("GET", "/v1/checkpoints/latest", "n1")
    assert status == 200 and view["info"] == infos[8]
    status, st = await api.call("GET", "/v1/status", None)
    assert st["checkpoint"] == infos[8] and st["round"] == 10
    assert api.coord.machine.db.get_meta("pruned_through") == "5"
    status, err = await api.call("POST", "/v1/checkpoints/6/upload", "n0", offer(b"late"))
    assert (status, err["error"]) == (409, "not_needed")


class ChunkCounting(S3Store):
    """The real store, noting the size of every chunk it hands the verifier."""

    chunks: list[int]

    async def read_chunks(self, key: str, max_size: int, consume: Any, **kw: Any) -> bool:
        self.chunks = []

        def counted(chunk: bytes) -> None:
            self.chunks.append(len(chunk))
            consume(chunk)

        return await super().read_chunks(key, max_size, counted, **kw)


@pytest.mark.asyncio
async def test_a_checkpoint_is_verified_in_chunks_and_a_deep_corruption_is_caught(
    store: EmbeddedStore, s3: Any
) -> None:
    """The verifier streams the object in chunks (512 bytes here, of a 33 kB file) and accepts
    the offered file; one flipped byte deep in the data section is caught by the sha256, and by
    the fingerprint when the offer claims the corrupted file's own size and sha256."""
    e = store.endpoint
    spy = ChunkCounting(
        endpoint_url=e.endpoint_url,
        bucket=e.bucket,
        access_key=e.access_key,
        secret_key=e.secret_key,
    )
    verifier = CheckpointVerifier(spy, chunk_bytes=512)
    gen = torch.Generator().manual_seed(7)
    tensors = {"w": torch.randn(64, 128, generator=gen), "b": torch.randn(64, generator=gen)}
    body = theta_file("streamed", tensors)
    prefix = f"verify-{uuid.uuid4().hex[:8]}/"
    good = CheckpointUpload.model_validate(offer(body, fingerprint(tensors)))
    s3.put_object(Bucket=e.bucket, Key=prefix + "good", Body=body)
    await verifier.verify(prefix + "good", good)
    assert len(spy.chunks) == -(-len(body) // 512) and max(spy.chunks) == 512

    corrupt = bytearray(body)
    corrupt[len(body) - 5000] ^= 0x10  # inside "w", far past the first chunks
    s3.put_object(Bucket=e.bucket, Key=prefix + "corrupt", Body=bytes(corrupt))
    with pytest.raises(BadCheckpoint, match="sha256"):
        await verifier.verify(prefix + "corrupt", good)
    claimed = CheckpointUpload.model_validate(offer(bytes(corrupt), fingerprint(tensors)))
    with pytest.raises(BadCheckpoint, match=f"not the offered {fingerprint(tensors)}"):
        await verifier.verify(prefix + "corrupt", claimed)

    smaller = good.model_copy(update={"size": len(body) - 1})
    with pytest.raises(BadCheckpoint, match="larger than the offered"):
        await verifier.verify(prefix + "good", smaller)
    assert spy.chunks == []  # refused on the store's Content-Length, before reading
    truncated = body[: len(body) - 3]
    s3.put_object(Bucket=e.bucket, Key=prefix + "truncated", Body=truncated)
    cut = CheckpointUpload.model_validate(offer(truncated, fingerprint(tensors)))
    with pytest.raises(BadCheckpoint, match="not a checkpoint of F32 tensors"):
        await verifier.verify(prefix + "truncated", cut)
    with pytest.raises(Conflict) as missing:
        await verifier.verify(prefix + "absent", good)
    assert missing.value.code == "missing"
    await spy.close()
