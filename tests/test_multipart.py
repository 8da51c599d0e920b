"""Multipart payload uploads through the real coordinator and the real SeaweedFS (no mock).

The node's own client and transfers (``CoordinatorClient``, ``HttpTransfers``) talk to the
coordinator app in-process (``make_api``) and to the session's ``weed mini``. The threshold and
part size are lowered to S3's smallest part (5 MiB), so a payload of 11-12 MiB goes in three
parts (``support.parts``). What is pinned here is what a node relies on:

- a multipart payload makes the whole round trip: grant, parts, completion, submit (the
  coordinator's HEAD check reads the store's digest of digests, ``…-3``), manifest, download;
- a part whose upload is cut half way is sent again alone (PUTs counted per part number), and
  a part whose retries are all spent costs that part: the submit step goes on with the same
  grant and sends it only;
- the key stays write-once: completing again, or completing another upload of other bytes at
  the same key, creates nothing and leaves the first object as it was;
- a part of other bytes of the same length is refused (400 ``BadDigest``) and not retried;
- the daemon's submit step and a checkpoint file (parts streamed from disk, completed by the
  grant holder only, verified whole by the coordinator's commit) take the same path.

The coordinator's and the store's side alone: ``test_multipart_store.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
import torch

from node.daemon import multipart, upload
from node.daemon.api import RealClock
from node.daemon.client import CoordinatorClient
from node.daemon.faults import Faults
from node.daemon.pending import PendingRound
from node.daemon.transfer import HttpTransfers
from node.errors import CoordinatorError, TransferError
from protocol.fingerprint import fingerprint
from protocol.messages import CheckpointUpload, ManifestView, SubmitRequest
from protocol.parts import PartPlan, UploadComplete, part_digests
from protocol.runconfig import RunConfig
from support.api import FP_A, ApiFactory, token
from support.parts import FAST, PART, CountingSession, node_client, open_run, small_parts
from support.theta_files import theta_file

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    small_parts(monkeypatch)


async def test_a_multipart_payload_makes_the_whole_round_trip(make_api: ApiFactory) -> None:
    api = await open_run(make_api)
    payload = os.urandom(12 << 20)
    sha = hashlib.sha256(payload).hexdigest()
    async with aiohttp.ClientSession() as http:
        client = node_client(api, http)
        transfers = HttpTransfers(http, policy=FAST)
        plan = multipart.part_plan(payload)
        assert plan is not None and len(plan.sha256) == 3
        grant = await client.upload_grant(0, len(payload), sha, plan)
        assert grant.multipart is not None and grant.url == ""
        assert [p.headers["Content-Length"] for p in grant.multipart.parts] == [
            str(PART), str(PART), str(2 << 20)
        ]  # fmt: skip
        parts = await transfers.put_parts(grant.multipart, payload)
        done = await client.upload_complete(
            0, UploadComplete(upload_id=grant.multipart.upload_id, parts=parts)
        )
        assert done.created
        resp = await client.submit(
            0, SubmitRequest(size=len(payload), sha256=sha, base_fingerprint=FP_A)
        )
        assert resp.accepted, resp
        view = await client.manifest(0)
        assert isinstance(view, ManifestView)
        [entry] = view.signed.manifest.gather
        got = await transfers.get(view.urls["n0"], size=entry.size, sha256=entry.sha256)
    assert got == payload


async def test_a_cut_part_is_sent_again_alone(make_api: ApiFactory, s3: Any) -> None:
    api = await open_run(make_api)
    payload = os.urandom(12 << 20)
    async with aiohttp.ClientSession() as http:
        client = node_client(api, http)
        counting = CountingSession(http, victim=2)
        transfers = HttpTransfers(cast(aiohttp.ClientSession, counting), policy=FAST)
        plan = multipart.part_plan(payload)
        grant = await client.upload_grant(
            0, len(payload), hashlib.sha256(payload).hexdigest(), plan
        )
        assert grant.multipart is not None
        parts = await transfers.put_parts(grant.multipart, payload)
        assert counting.puts == {1: 1, 2: 2, 3: 1}
        assert transfers.counts.retried_parts == 1
        done = await client.upload_complete(
            0, UploadComplete(upload_id=grant.multipart.upload_id, parts=parts)
        )
    assert done.created
    stored = s3.get_object(Bucket=api.config.storage.bucket, Key=grant.key)["Body"].read()
    assert stored == payload


async def test_the_key_stays_write_once(make_api: ApiFactory, s3: Any) -> None:
    api = await open_run(make_api)
    first = os.urandom(12 << 20)
    other = os.urandom(12 << 20)  # same size, other bytes
    async with aiohttp.ClientSession() as http:
        client = node_client(api, http)
        transfers = HttpTransfers(http, policy=FAST)

        async def upload(data: bytes) -> tuple[str, UploadComplete]:
            plan = multipart.part_plan(data)
            grant = await client.upload_grant(0, len(data), hashlib.sha256(data).hexdigest(), plan)
            assert grant.multipart is not None
            parts = await transfers.put_parts(grant.multipart, data)
            return grant.key, UploadComplete(upload_id=grant.multipart.upload_id, parts=parts)

        key, done = await upload(first)
        assert (await client.upload_complete(0, done)).created
        # The same completion again (its answer was lost): nothing new.
        assert not (await client.upload_complete(0, done)).created
        # Another upload of other bytes to the same key: refused by the store (412).
        _, again = await upload(other)
        assert not (await client.upload_complete(0, again)).created
    stored = s3.get_object(Bucket=api.config.storage.bucket, Key=key)["Body"].read()
    assert hashlib.sha256(stored).digest() == hashlib.sha256(first).digest()


async def test_a_part_of_other_bytes_is_refused(make_api: ApiFactory) -> None:
    api = await open_run(make_api)
    payload = os.urandom(12 << 20)
    forged = bytearray(payload)
    forged[PART + 7] ^= 0xFF  # one byte of part 2, same length
    async with aiohttp.ClientSession() as http:
        client = node_client(api, http)
        counting = CountingSession(http)
        transfers = HttpTransfers(cast(aiohttp.ClientSession, counting), policy=FAST)
        plan = PartPlan(part_size=PART, sha256=part_digests(payload, PART))
        grant = await client.upload_grant(
            0, len(payload), hashlib.sha256(payload).hexdigest(), plan
        )
        assert grant.multipart is not None
        with pytest.raises(TransferError) as err:
            await transfers.put_parts(grant.multipart, bytes(forged))
    assert err.value.status == 400 and "BadDigest" in str(err.value)
    assert counting.puts[2] == 1  # a refusal is not retried


class _Daemon:
    """The few things ``node.daemon.upload.submit`` uses of a daemon."""

    def __init__(self, api: CoordinatorClient, transfers: HttpTransfers) -> None:
        self.api = api
        self.transfers = transfers
        self.faults = Faults()
        self.clock = RealClock()
        self.stopping = asyncio.Event()
        self.node_id = "n0"
        self.events: list[str] = []
        self.measured: list[tuple[int, float]] = []

    def log(self, event: str, **fields: object) -> None:
        self.events.append(event)

    def uploaded(self, size: int, seconds: float) -> None:
        self.measured.append((size, seconds))

    link_failures = 0

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def test_the_daemons_submit_step_uploads_a_large_payload_in_parts(
    make_api: ApiFactory, s3: Any
) -> None:
    """``upload.submit``: plan, grant, parts, completion, submit; the round takes it."""
    api = await open_run(make_api)
    payload = os.urandom(11 << 20)
    sha = hashlib.sha256(payload).hexdigest()
    pending = PendingRound(round=0, payload=payload, sha256=sha, base=FP_A)
    async with aiohttp.ClientSession() as http:
        counting = CountingSession(http, victim=1)
        d = _Daemon(
            node_client(api, http),
            HttpTransfers(cast(aiohttp.ClientSession, counting), policy=FAST),
        )
        await upload.submit(cast(Any, d), pending)
        view = await d.api.manifest(0)
    assert d.events == [] and pending.bytes_up == len(payload)
    assert [size for size, _ in d.measured] == [len(payload)]  # the link measured once
    assert counting.puts == {1: 2, 2: 1, 3: 1}
    assert isinstance(view, ManifestView) and [e.sha256 for e in view.signed.manifest.gather] == [
        sha
    ]
    key = view.signed.manifest.gather[0].key
    assert s3.get_object(Bucket=api.config.storage.bucket, Key=key)["Body"].read() == payload


class _CountingApi:
    """The client, counting upload grants."""

    def __init__(self, client: CoordinatorClient) -> None:
        self.client = client
        self.grants = 0

    async def upload_grant(self, *args: Any) -> Any:
        self.grants += 1
        return await self.client.upload_grant(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


async def test_a_part_that_gives_up_costs_that_part_not_the_upload(make_api: ApiFactory) -> None:
    """Part 2's retries are spent (the store away longer than a part's budget): the submit
    step tries again with the same grant and sends part 2 only, then completes."""
    api = await open_run(make_api)
    payload = os.urandom(11 << 20)
    sha = hashlib.sha256(payload).hexdigest()
    pending = PendingRound(round=0, payload=payload, sha256=sha, base=FP_A)
    async with aiohttp.ClientSession() as http:
        counting = CountingSession(http, victim=2, cuts=int(FAST.attempts))
        counted = _CountingApi(node_client(api, http))
        transfers = HttpTransfers(cast(aiohttp.ClientSession, counting), policy=FAST)
        d = _Daemon(cast(CoordinatorClient, counted), transfers)
        await upload.submit(cast(Any, d), pending)
        view = await d.api.manifest(0)
    assert d.events == [] and counted.grants == 1
    assert counting.puts == {1: 1, 2: int(FAST.attempts) + 1, 3: 1}
    assert isinstance(view, ManifestView) and [e.sha256 for e in view.signed.manifest.gather] == [
        sha
    ]


async def test_a_large_checkpoint_goes_in_parts_and_is_verified_whole(
    make_api: ApiFactory, s3: Any, tmp_path: Path
) -> None:
    """A checkpoint file above the threshold: grant in parts, parts streamed from disk, the
    holder completes (nobody else may), the commit verifies the whole file as always."""
    theta = {"w": torch.arange(3_000_000, dtype=torch.float32)}  # 12 MB of tensor
    fp = fingerprint(theta)
    path = tmp_path / "theta.safetensors"
    path.write_bytes(theta_file("big", theta))
    size = path.stat().st_size
    api = await make_api(RunConfig(name="bigckpt", min_nodes=2, rounds=5, checkpoint_every=2))
    for node in ("n0", "n1"):
        assert (await api.call("POST", "/v1/join", node, {}))[0] == 200
    for r in (0, 1):
        for node in ("n0", "n1"):
            assert (await api.contribute(node, r, fp))["accepted"]
        assert (await api.manifest("n0", r))[0] == 200
        for node in ("n0", "n1"):
            assert (await api.call("POST", f"/v1/rounds/{r}/report", node, {"fingerprint": fp}))[
                0
            ] == 200
    plan = multipart.file_part_plan(path, size)
    assert plan is not None and len(plan.sha256) == 3
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    offer = CheckpointUpload(size=size, sha256=sha, fingerprint=fp, parts=plan)
    async with aiohttp.ClientSession() as http:
        client = node_client(api, http)
        transfers = HttpTransfers(http, policy=FAST)
        grant = await client.checkpoint_grant(2, offer)
        assert grant.multipart is not None
        parts = await transfers.put_file_parts(grant.multipart, path, size=size)
        done = UploadComplete(upload_id=grant.multipart.upload_id, parts=parts)
        other = CoordinatorClient(http, str(api.client.make_url("")), token("n1"), policy=FAST)
        with pytest.raises(CoordinatorError) as err:
            await other.checkpoint_complete(2, done)
        assert err.value.error == "not_granted"
        assert (await client.checkpoint_complete(2, done)).created
        info = await client.checkpoint_commit(2, offer)
    assert (info.size, info.sha256, info.fingerprint) == (size, sha, fp)
    stored = s3.get_object(Bucket=api.config.storage.bucket, Key=grant.key)["Body"].read()
    assert stored == path.read_bytes()
