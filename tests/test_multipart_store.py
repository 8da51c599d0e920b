"""Multipart uploads from the coordinator's and the store's side, against SeaweedFS.

- what SeaweedFS 4.48 enforces, measured and pinned: a presigned part with another length, no
  checksum header or another part number gets 403, other bytes of its length 400
  ``BadDigest``; a completion with ``If-None-Match: *`` at a key that holds an object 412;
- the coordinator refuses part plans that do not cut the announced size, or parts below S3's
  minimum; bodies that list thousands of parts are taken, whatever ``max_body_bytes`` says for
  other bodies;
- a completion that names another sha256 for a part than it was uploaded with is refused by
  the store (``BadDigest``) and the node told to start over; a store that refuses to create a
  multipart upload gets a single PUT, one that does not answer a 503;
- retention aborts uploads older than their grants, and a store that cannot list its uploads
  never stops the other rules.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any, cast

import aiohttp
import pytest
from botocore.exceptions import ClientError
from yarl import URL

from coordinator.base.errors import StorageError
from coordinator.store.object_store import sha256_b64
from coordinator.store.storage import S3Store
from node.daemon import multipart
from node.daemon.transfer import HttpTransfers
from protocol.runconfig import RunConfig
from support.api import ApiFactory
from support.parts import PART, node_client, open_run, small_parts

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True)
def _small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    small_parts(monkeypatch)


async def test_parts_that_do_not_cut_the_size_are_refused(make_api: ApiFactory) -> None:
    api = await open_run(make_api)
    body = {
        "size": 12 << 20,
        "sha256": "0" * 64,
        "parts": {"part_size": PART, "sha256": ["0" * 64] * 2},
    }
    status, answer = await api.call("POST", "/v1/rounds/0/upload", "n0", body)
    assert status == 422 and answer["error"] == "bad_parts"
    body["parts"] = {"part_size": 1 << 20, "sha256": ["0" * 64] * 12}  # below S3's minimum
    status, answer = await api.call("POST", "/v1/rounds/0/upload", "n0", body)
    assert status == 422


async def test_retention_aborts_uploads_older_than_their_grants(
    make_api: ApiFactory, s3: Any
) -> None:
    api = await open_run(make_api)
    payload = os.urandom(12 << 20)
    async with aiohttp.ClientSession() as http:
        client = node_client(api, http)
        plan = multipart.part_plan(payload)
        grant = await client.upload_grant(
            0, len(payload), hashlib.sha256(payload).hexdigest(), plan
        )
    bucket = api.config.storage.bucket
    prefix = grant.key.split("/rounds/")[0]

    def uploads() -> list[str]:
        return [
            u["UploadId"]
            for u in s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        ]

    assert grant.multipart is not None and uploads() == [grant.multipart.upload_id]
    parts = api.coord.parts
    assert parts is not None
    assert await parts.abort_stale(prefix, older_than_s=3600) == 0  # young: kept
    assert await parts.abort_stale(prefix, older_than_s=0) == 1
    assert uploads() == []


async def test_a_grant_of_thousands_of_parts_is_not_refused_for_its_body(
    make_api: ApiFactory,
) -> None:
    """Bodies that list parts may exceed ``max_body_bytes`` (64 KiB here) up to what 10,000
    parts need; other bodies may not."""
    api = await make_api(
        RunConfig(name="manyparts", min_nodes=1, rounds=2), max_payload_bytes=20 << 30
    )
    assert (await api.call("POST", "/v1/join", "n0", {}))[0] == 200
    n = 2000
    plan = {"part_size": PART, "sha256": [f"{i:064x}" for i in range(n)]}
    body = {"size": n * PART, "sha256": "0" * 64, "parts": plan}
    status, grant = await api.call("POST", "/v1/rounds/0/upload", "n0", body)
    assert status == 200, grant
    assert len(grant["multipart"]["parts"]) == n
    done = {
        "upload_id": grant["multipart"]["upload_id"],
        "parts": [{"number": i + 1, "etag": '"0"', "sha256": f"{i:064x}"} for i in range(n)],
    }
    status, answer = await api.call("POST", "/v1/rounds/0/upload/complete", "n0", done)
    assert (status, answer["error"]) == (409, "upload_incomplete")  # no part was uploaded
    status, answer = await api.call("POST", "/v1/join", "n0", {"client": "x" * 70_000})
    assert status == 413  # any other body: the server's max_body_bytes


async def test_what_the_store_enforces_on_parts_and_completions(store: Any, s3: Any) -> None:
    """The measurements the design rests on, pinned against SeaweedFS: a presigned part with
    another length (403), without its checksum header (403), of other bytes (400 BadDigest) or
    under another part number (403) is refused; a completion with ``If-None-Match: *`` at a key
    that holds an object is refused (412) and the object stays."""
    e = store.endpoint
    s3store = S3Store(
        endpoint_url=e.endpoint_url, bucket=e.bucket, access_key=e.access_key,
        secret_key=e.secret_key, expiry_s=60,
    )  # fmt: skip
    key = "multipart/enforced.bin"
    s3.put_object(Bucket=e.bucket, Key=key, Body=b"first")
    upload_id = s3.create_multipart_upload(Bucket=e.bucket, Key=key, ChecksumAlgorithm="SHA256")[
        "UploadId"
    ]
    part = os.urandom(PART)
    sha = hashlib.sha256(part).hexdigest()
    url, headers = s3store.presign_part(key, upload_id, 1, len(part), sha)

    async def put(target: str, body: bytes, sent: dict[str, str]) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession() as http,
            http.put(URL(target, encoded=True), data=io.BytesIO(body), headers=sent) as r,
        ):
            return r.status, await r.text()

    longer = {**headers, "Content-Length": str(len(part) + 1)}
    assert (await put(url, part + b"x", longer))[0] == 403
    assert (await put(url, part, {"Content-Length": str(len(part))}))[0] == 403
    forged = bytes([part[0] ^ 1]) + part[1:]
    status, text = await put(url, forged, headers)
    assert status == 400 and "BadDigest" in text
    assert (await put(url.replace("partNumber=1", "partNumber=2"), part, headers))[0] == 403
    status, _ = await put(url, part, headers)
    assert status == 200
    etag = s3.list_parts(Bucket=e.bucket, Key=key, UploadId=upload_id)["Parts"][0]["ETag"]
    listed = [{"PartNumber": 1, "ETag": etag, "ChecksumSHA256": sha256_b64(sha)}]
    with pytest.raises(ClientError) as err:
        s3.complete_multipart_upload(
            Bucket=e.bucket, Key=key, UploadId=upload_id,
            MultipartUpload={"Parts": listed}, IfNoneMatch="*",
        )  # fmt: skip
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert s3.get_object(Bucket=e.bucket, Key=key)["Body"].read() == b"first"
    s3.abort_multipart_upload(Bucket=e.bucket, Key=key, UploadId=upload_id)


async def test_a_store_that_cannot_list_uploads_never_stops_retention(make_api: ApiFactory) -> None:
    api = await open_run(make_api)

    class Unlisting:
        calls = 0

        async def abort_stale(self, prefix: str, older_than_s: float) -> int:
            self.calls += 1
            raise StorageError("list uploads: NotImplemented", code="NotImplemented")

    broken = Unlisting()
    api.coord.retention.parts = cast(Any, broken)
    assert await api.coord.retention.prune_once() == 0
    assert broken.calls == 1


async def test_a_store_that_refuses_uploads_in_parts_gets_one_put(
    make_api: ApiFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No permission to create a multipart upload: the grant is a single PUT (every try would
    be refused the same); a store that does not answer: 503, which the node waits out."""
    api = await open_run(make_api)
    parts = api.coord.parts
    assert parts is not None
    code: str | None = "AccessDenied"

    async def refuse(key: str) -> str:
        raise StorageError(f"create upload {key}: refused", code=code)

    monkeypatch.setattr(parts, "create", refuse)
    body = {
        "size": 2 * PART,
        "sha256": "0" * 64,
        "parts": {"part_size": PART, "sha256": ["0" * 64] * 2},
    }
    status, grant = await api.call("POST", "/v1/rounds/0/upload", "n0", body)
    assert status == 200 and grant["multipart"] is None and grant["headers"]["If-None-Match"] == "*"
    code = None
    status, answer = await api.call("POST", "/v1/rounds/0/upload", "n0", body)
    assert (status, answer["error"]) == (503, "storage_unavailable")


async def test_a_completion_that_lies_about_a_part_is_refused(make_api: ApiFactory) -> None:
    """The store checks each part's sha256 named in the completion against the one the part
    was uploaded with (``BadDigest``): the node hears ``upload_incomplete`` and starts over."""
    api = await open_run(make_api)
    payload = os.urandom(2 * PART)
    async with aiohttp.ClientSession() as http:
        client = node_client(api, http)
        plan = multipart.part_plan(payload)
        grant = await client.upload_grant(
            0, len(payload), hashlib.sha256(payload).hexdigest(), plan
        )
        assert grant.multipart is not None
        parts = await HttpTransfers(http).put_parts(grant.multipart, payload)
    lying = [p.model_dump() for p in parts]
    lying[1]["sha256"] = "0" * 64
    done = {"upload_id": grant.multipart.upload_id, "parts": lying}
    status, answer = await api.call("POST", "/v1/rounds/0/upload/complete", "n0", done)
    assert (status, answer["error"]) == (409, "upload_incomplete")
