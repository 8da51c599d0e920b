"""``sparseloco store check`` and what the coordinator does with its answer, on three stores.

- SeaweedFS 4.48 (the session's store): every promise kept; the command exits 0.
- moto's server: no signature, signed length or checksum checked; the check names exactly
  those promises as not kept and exits 1, a coordinator refuses to start there with the reason
  and the fix, and starts when the operator accepts the risk (``storage.accept_unbound_uploads``),
  saying so.
- MiniStack: everything kept but the 5 MiB part minimum, which the project does not need.
- moto and MiniStack both carry a payload of three parts through the coordinator's grants.
- SeaweedFS behind ``support.s3proxy``: a store that ignores ``If-None-Match`` (the proxy lets a
  second write replace the first) and one that refuses requests carrying it (as Backblaze B2
  does). The check finds both; the coordinator then names payload keys by their sha256, and a
  second upload with other bytes never replaces what a manifest names (write-once by naming);
  the header is left out of grants where the store refuses it.

Every command runs as the operator types it (the console script); nothing printed holds a
secret; the check leaves nothing behind in the bucket.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from yarl import URL

from coordinator.base.errors import StorageError
from coordinator.store.conformance import check_promises
from coordinator.store.promises import StoreProfile
from coordinator.store.storage import S3Store
from node.cluster.launch import coordinator_toml
from node.cluster.seaweed import EmbeddedStore, StoreEndpoint
from node.daemon import multipart
from node.daemon.transfer import HttpTransfers
from protocol.runconfig import RunConfig
from support.api import ApiFactory
from support.parts import node_client, small_parts
from support.s3proxy import S3Proxy
from support.s3servers import MiniStackStore, MotoStore, ServerStore

#: The promises moto's server does not keep: nothing binds an upload to its URL.
MOTO_MISSING = {
    "PUT signed length: other length",
    "PUT signed sha256: other bytes",
    "URL sent to another key",
    "part signed length: other length",
    "part signed sha256: other bytes",
    "expired URL",
}
ROW = re.compile(r"^(.+?)\s{2,}(yes|NO|-)\s{2,}")


def rows(out: str) -> dict[str, str]:
    """The table's rows: promise -> yes / NO / -."""
    found = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m and m.group(1) != "promise":
            found[m.group(1)] = m.group(2)
    return found


def store_check(endpoint: StoreEndpoint, *args: str) -> subprocess.CompletedProcess[str]:
    """``sparseloco store check`` as an operator runs it, credentials in the environment."""
    env = dict(
        os.environ, AWS_ACCESS_KEY_ID=endpoint.access_key, AWS_SECRET_ACCESS_KEY=endpoint.secret_key
    )
    return subprocess.run(
        ["sparseloco", "store", "check", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_no_secret(endpoint: StoreEndpoint, *texts: str) -> None:
    for text in texts:
        assert endpoint.secret_key not in text


def left_under(client: Any, bucket: str, prefix: str) -> list[str]:
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return [o["Key"] for o in listed]


def test_every_promise_holds_on_seaweedfs(store: EmbeddedStore) -> None:
    e = store.endpoint
    done = store_check(e, "--endpoint-url", e.endpoint_url, "--bucket", e.bucket, "--prefix", "sc")
    assert done.returncode == 0, done.stdout + done.stderr
    found = rows(done.stdout)
    assert len(found) >= 13 and set(found.values()) == {"yes"}, done.stdout
    assert "a coordinator would start: every promise is kept" in done.stdout
    assert_no_secret(e, done.stdout, done.stderr)
    assert left_under(store.client(), e.bucket, "sc/") == []


def test_moto_is_named_for_what_it_does_not_bind(moto: MotoStore) -> None:
    e = moto.endpoint
    done = store_check(e, "--endpoint-url", e.endpoint_url, "--bucket", e.bucket, "--prefix", "sc")
    assert done.returncode == 1, done.stdout + done.stderr
    found = rows(done.stdout)
    assert {p for p, kept in found.items() if kept == "NO"} == MOTO_MISSING, done.stdout
    for kept in ("PUT If-None-Match: second write", "Complete If-None-Match: second"):
        assert found[kept] == "yes"
    assert "would refuse to start" in done.stdout
    assert "accept_unbound_uploads" in done.stdout
    assert_no_secret(e, done.stdout, done.stderr)
    assert left_under(moto.client(), e.bucket, "sc/") == []


def test_ministack_binds_the_bytes_and_keeps_write_once(ministack: MiniStackStore) -> None:
    """MiniStack checks signatures, lengths and checksums like a real store; of the promises
    only the 5 MiB part minimum is not kept, which the project does not need."""
    e = ministack.endpoint
    done = store_check(e, "--endpoint-url", e.endpoint_url, "--bucket", e.bucket, "--prefix", "sc")
    assert done.returncode == 0, done.stdout + done.stderr
    found = rows(done.stdout)
    assert {p for p, kept in found.items() if kept == "NO"} == {"part under 5 MiB (not the last)"}
    assert "what the store does not keep, the project does not need" in done.stdout
    assert_no_secret(e, done.stdout, done.stderr)
    assert left_under(ministack.client(), e.bucket, "sc/") == []


def test_bad_flags_and_an_unreachable_store_are_one_line_each(store: EmbeddedStore) -> None:
    e = store.endpoint
    done = store_check(e, "--bucket", e.bucket)
    assert done.returncode == 2 and "--endpoint-url" in done.stderr
    done = store_check(e, "--endpoint-url", "http://127.0.0.1:9", "--bucket", e.bucket)
    assert done.returncode == 1 and "cannot reach the object store" in done.stderr
    done = store_check(e, "--endpoint-url", e.endpoint_url, "--bucket", "no-such-bucket-here")
    assert done.returncode == 1 and "does not exist" in done.stderr
    assert_no_secret(e, done.stdout, done.stderr)


def _config(tmp_path: Path, endpoint: StoreEndpoint, **storage: Any) -> Path:
    run = RunConfig(name="store-check", min_nodes=1, rounds=2)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "run.toml"
    text = coordinator_toml(
        run, endpoint, {"n0": "t" * 24}, tmp_path / "state", prefix="c", storage=storage
    )
    path.write_text(text)
    return path


def test_a_coordinator_refuses_moto_unless_the_risk_is_accepted(
    moto: MotoStore, tmp_path: Path
) -> None:
    config = _config(tmp_path / "refused", moto.endpoint)
    done = subprocess.run(
        ["sparseloco", "coordinator", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "does not bind an upload's bytes" in done.stderr
    assert "storage.accept_unbound_uploads = true" in done.stderr
    # Nothing written before the checks: no database, no signing key.
    assert not list((tmp_path / "refused").glob("state/*"))
    assert_no_secret(moto.endpoint, done.stdout, done.stderr)
    # The same check, from the config the coordinator would read: the risk accepted, exit 0.
    accepted = _config(tmp_path / "accepted", moto.endpoint, accept_unbound_uploads=True)
    done = store_check(moto.endpoint, "--config", str(accepted))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RISK ACCEPTED" in done.stdout


@pytest.fixture(params=["overwrite", "refuse"])
def proxy(request: pytest.FixtureRequest, store: EmbeddedStore) -> Iterator[S3Proxy]:
    """SeaweedFS behind a proxy that ignores (``overwrite``) or refuses ``If-None-Match``."""
    p = S3Proxy(store.endpoint, request.param)
    p.start()
    try:
        yield p
    finally:
        p.stop()


def s3_store(endpoint: StoreEndpoint) -> S3Store:
    return S3Store(
        endpoint_url=endpoint.endpoint_url,
        bucket=endpoint.bucket,
        access_key=endpoint.access_key,
        secret_key=endpoint.secret_key,
    )


@pytest.mark.asyncio
async def test_a_store_without_write_once_is_found_and_worked_around(proxy: S3Proxy) -> None:
    s3 = s3_store(proxy.endpoint)
    try:
        report = await check_promises(s3, "proxied/")
    finally:
        await s3.close()
    found = {f.promise: f.kept for f in report.findings}
    assert found["PUT If-None-Match: second write"] is False
    assert found["Complete If-None-Match: second"] is False
    assert found["PUT signed sha256: other bytes"] is True  # the rest still holds
    profile = report.profile
    assert profile.digest_keys and profile.bound and not profile.problems()
    assert profile.put_header is (proxy.mode == "overwrite")
    assert profile.complete_header is (proxy.mode == "overwrite")
    # A grant made with this profile is accepted by the store it was found on.
    s3.adopt(profile)
    data = b"a payload"
    url, headers = s3.presign_put("proxied/grant.slc", len(data), hashlib.sha256(data).hexdigest())
    assert ("If-None-Match" in headers) is profile.put_header
    async with (
        aiohttp.ClientSession() as http,
        http.put(URL(url, encoded=True), data=data, headers=headers) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def _grant(api: Any, node: str, body: bytes) -> dict[str, Any]:
    status, grant = await api.call(
        "POST",
        "/v1/rounds/0/upload",
        node,
        {"size": len(body), "sha256": hashlib.sha256(body).hexdigest()},
    )
    assert status == 200, grant
    return dict(grant)


async def _put(grant: dict[str, Any], body: bytes) -> int:
    async with (
        aiohttp.ClientSession() as http,
        http.put(URL(grant["url"], encoded=True), data=body, headers=grant["headers"]) as r,
    ):
        return r.status


@pytest.mark.asyncio
@pytest.mark.parametrize("naming", [True, False])
async def test_a_second_upload_never_replaces_what_the_manifest_names(
    make_api: ApiFactory, store: EmbeddedStore, naming: bool
) -> None:
    """Behind the proxy that lets a second write replace the first, a node takes grants for A
    and for B (other bytes), uploads A, submits it, and once the manifest names A uploads B.
    With keys named by digest (what the coordinator does on such a store) B lands elsewhere and
    A stays where the manifest says; without (the control) B replaces A at that very key."""
    proxy = S3Proxy(store.endpoint, "overwrite")
    endpoint = proxy.start()
    s3 = s3_store(endpoint)
    try:
        if naming:
            s3.adopt((await check_promises(s3, "naming/")).profile)
        run = RunConfig(name="naming", min_nodes=1, gather_size=4, rounds=2)
        api = await make_api(run, endpoint=endpoint, object_store=s3)
        assert (await api.call("POST", "/v1/join", "n0", {}))[0] == 200
        first, second = b"the payload A " * 64, b"the payload B " * 64
        grant_a, grant_b = await _grant(api, "n0", first), await _grant(api, "n0", second)
        assert (grant_a["key"] != grant_b["key"]) is naming
        assert await _put(grant_a, first) == 200
        status, resp = await api.submit("n0", 0, first, "a" * 32)
        assert status == 200 and resp["accepted"], resp
        status, manifest = await api.manifest("n0", 0)
        assert status == 200, manifest
        [entry] = manifest["signed"]["manifest"]["gather"]
        assert entry["sha256"] == hashlib.sha256(first).hexdigest()
        assert await _put(grant_b, second) == 200  # the second write, after the manifest
        stored = store.client().get_object(Bucket=endpoint.bucket, Key=entry["key"])["Body"].read()
        if naming:
            assert entry["key"] == grant_a["key"] and entry["sha256"] in entry["key"]
            assert stored == first
        else:
            assert stored == second  # the store let the second write through: the control
    finally:
        await s3.close()
        proxy.stop()


@pytest.mark.asyncio
@pytest.mark.parametrize("server", ["moto", "ministack"])
async def test_a_payload_in_parts_crosses_the_other_servers(
    make_api: ApiFactory,
    server: str,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A payload of three parts (5, 5 and 2 MiB) through the coordinator's grants on moto and
    on MiniStack: every part presigned, uploaded and completed, the object whole and
    write-once."""
    other: ServerStore = request.getfixturevalue(server)
    small_parts(monkeypatch)
    run = RunConfig(name="other-parts", min_nodes=1, gather_size=4, rounds=2)
    api = await make_api(run, endpoint=other.endpoint)
    assert (await api.call("POST", "/v1/join", "n0", {}))[0] == 200
    payload = os.urandom(12 << 20)
    async with aiohttp.ClientSession() as http:
        client = node_client(api, http)
        plan = multipart.part_plan(payload)
        assert plan is not None and len(plan.sha256) == 3
        grant = await client.upload_grant(
            0, len(payload), hashlib.sha256(payload).hexdigest(), plan
        )
        assert grant.multipart is not None
        parts = await HttpTransfers(http).put_parts(grant.multipart, payload)
    done = {"upload_id": grant.multipart.upload_id, "parts": [p.model_dump() for p in parts]}
    status, answer = await api.call("POST", "/v1/rounds/0/upload/complete", "n0", done)
    assert (status, answer) == (200, {"created": True})
    stored = other.client().get_object(Bucket=other.bucket, Key=grant.key)["Body"].read()
    assert stored == payload
    # Completing again never replaces it (both keep If-None-Match on the completion).
    status, answer = await api.call("POST", "/v1/rounds/0/upload/complete", "n0", done)
    assert status in (200, 409) and answer.get("created") is not True, answer


@pytest.mark.asyncio
async def test_a_store_that_cannot_serve_now_fails_the_check_instead_of_a_verdict() -> None:
    """503 SlowDown to every probe: an outage says nothing about a promise, so the check
    raises an unreachable ``StorageError`` (the coordinator's start then fails and is retried)
    rather than concluding that the store keeps nothing."""
    slow = b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>later</Message></Error>"

    async def answer(request: web.Request) -> web.Response:
        return web.Response(status=503, body=slow, content_type="application/xml")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    async with TestServer(app) as server:
        s3 = s3_store(StoreEndpoint(str(server.make_url("")).rstrip("/"), "b", "k", "s"))
        try:
            with pytest.raises(StorageError) as caught:
                await check_promises(s3, "down/")
        finally:
            await s3.close()
    assert caught.value.unreachable, caught.value


@pytest.mark.asyncio
async def test_grants_that_also_sign_the_checksum_algorithm_work_on_a_real_store(
    store: EmbeddedStore,
) -> None:
    """Ceph RGW checks a signed checksum only with ``x-amz-sdk-checksum-algorithm`` signed too;
    a coordinator that found that signs it in every grant. Such a grant, on SeaweedFS: the
    header is signed (boto3 signs the same URL), the payload lands, other bytes do not."""
    s3 = s3_store(store.endpoint)
    s3.adopt(StoreProfile(sdk_checksum=True))
    data = os.urandom(2048)
    url, headers = s3.presign_put("sdk/grant.slc", len(data), hashlib.sha256(data).hexdigest())
    assert headers["x-amz-sdk-checksum-algorithm"] == "SHA256"
    assert "x-amz-sdk-checksum-algorithm" in url.split("X-Amz-SignedHeaders=")[1].split("&")[0]
    async with aiohttp.ClientSession() as http:
        other = bytes(b ^ 1 for b in data)
        async with http.put(URL(url, encoded=True), data=other, headers=headers) as resp:
            assert resp.status == 400, await resp.text()
        async with http.put(URL(url, encoded=True), data=data, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
    await s3.close()
