"""The SigV4 presigner (``coordinator.store.presign``): boto3's URLs, character for character, and a
store that really accepts them.

- for endpoints of several shapes (SeaweedFS on a port, AWS, R2, a default port, a base path)
  and keys with characters that must be encoded, the presigner gives exactly boto3's URL for
  the same request at the same second, for each kind the coordinator hands out (PUT bound to
  size, checksum and write-once; GET; HEAD asking for the checksum; a multipart upload's part,
  bound to size and checksum, with its upload id and number in the query; a listing's page);
- ``S3Store`` uses it only when that holds when it is built, and boto3 otherwise;
- against the session's SeaweedFS store: a presigned PUT stores the payload once (a second is
  refused), its GET reads it back, and ``head`` sees its size and checksum; ``sizes`` lists a
  folder page by page through presigned URLs (not boto3), keys that need encoding included, and
  a listing the store refuses is a refusal, not an outage;
- a store's answer that is not a listing is a ``StorageError``, never a partial listing.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import aiohttp
import boto3
import pytest
from botocore.config import Config

from coordinator.base.errors import StorageError
from coordinator.store import storage
from coordinator.store.head import parse_list_page
from coordinator.store.object_store import sha256_b64
from coordinator.store.presign import (
    BucketAccess,
    SigV4Presigner,
    list_request,
    matches_botocore,
    signed_at,
)
from coordinator.store.storage import S3Store
from node.cluster.seaweed import EmbeddedStore

ENDPOINTS = [
    ("http://127.0.0.1:8333", "us-east-1"),
    ("https://s3.eu-west-1.amazonaws.com", "eu-west-1"),
    ("https://account.r2.cloudflarestorage.com", "auto"),
    ("http://127.0.0.1:80", "us-east-1"),
    ("https://objects.example.com/base/", "us-east-1"),
]
KEYS = ["runs/run-1/rounds/00012/n00007.bin", "runs/r 1/00000/nöde_a-~+%.bin"]


def boto_client(endpoint: str, region: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="AKIDEXAMPLE/1",
        aws_secret_access_key="wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
        region_name=region,
        config=Config(signature_version="s3v4"),
    )


@pytest.mark.parametrize(("endpoint", "region"), ENDPOINTS)
@pytest.mark.parametrize("key", KEYS)
def test_presigner_gives_boto3s_urls(endpoint: str, region: str, key: str) -> None:
    client = boto_client(endpoint, region)
    signer = SigV4Presigner(
        BucketAccess(
            endpoint_url=endpoint,
            bucket="sparseloco",
            access_key="AKIDEXAMPLE/1",
            secret_key="wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY",
            region=region,
        )
    )
    checksum = sha256_b64(hashlib.sha256(b"payload").hexdigest())
    put = client.generate_presigned_url(
        "put_object",
        Params={
            "Bucket": "sparseloco",
            "Key": key,
            "ContentLength": 7,
            "ChecksumSHA256": checksum,
            "IfNoneMatch": "*",
        },
        ExpiresIn=900,
    )
    headers = {"Content-Length": "7", "x-amz-checksum-sha256": checksum, "If-None-Match": "*"}
    assert matches_botocore(signer, put, "PUT", key, 900, headers)
    get = client.generate_presigned_url(
        "get_object", Params={"Bucket": "sparseloco", "Key": key}, ExpiresIn=600
    )
    assert matches_botocore(signer, get, "GET", key, 600)
    assert not matches_botocore(signer, get, "GET", key, 601)  # a different request differs
    head = client.generate_presigned_url(
        "head_object",
        Params={"Bucket": "sparseloco", "Key": key, "ChecksumMode": "ENABLED"},
        ExpiresIn=60,
    )
    assert matches_botocore(signer, head, "HEAD", key, 60, {"x-amz-checksum-mode": "ENABLED"})
    for upload_id in ("3f2a_9b", "up+load/id=~"):  # a multipart upload's part, its own query
        part = client.generate_presigned_url(
            "upload_part",
            Params={
                "Bucket": "sparseloco",
                "Key": key,
                "UploadId": upload_id,
                "PartNumber": 12,
                "ContentLength": 7,
                "ChecksumSHA256": checksum,
            },
            ExpiresIn=900,
        )
        part_headers = {"Content-Length": "7", "x-amz-checksum-sha256": checksum}
        query = [("uploadId", upload_id), ("partNumber", "12")]
        assert matches_botocore(signer, part, "PUT", key, 900, part_headers, query)
        assert not matches_botocore(signer, part, "PUT", key, 900, part_headers, query[:1])
    for prefix, token in (("runs/r 1/00012/", None), (key, "1/tok+en=="), ("", None)):
        request = list_request(prefix, token, max_keys=2)
        listing = client.generate_presigned_url(
            "list_objects_v2", Params={"Bucket": "sparseloco", **request.params}, ExpiresIn=60
        )
        assert matches_botocore(signer, listing, "GET", "", 60, None, request.query)
    # The signing key is kept per day; a URL of another day is signed with that day's key.
    later = signer.presign("GET", key, 600, now=signed_at(get) + 86400)
    assert "X-Amz-Date=" in later and later != get


def make_store(endpoint: str = "http://127.0.0.1:8333") -> S3Store:
    return S3Store(
        endpoint_url=endpoint,
        bucket="sparseloco",
        access_key="AKIDEXAMPLE",
        secret_key="secret-key-example",
        expiry_s=900,
    )


def test_store_signs_with_boto3_when_the_presigner_disagrees(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert make_store()._presigner is not None
    monkeypatch.setattr(storage, "matches_botocore", lambda *args, **kwargs: False)
    store = make_store()
    assert store._presigner is None
    url, headers = store.presign_put("runs/r/0/n.bin", 7, hashlib.sha256(b"x").hexdigest())
    assert url.startswith("http://127.0.0.1:8333/sparseloco/runs/r/0/n.bin?")
    assert "X-Amz-Signature=" in url and headers["If-None-Match"] == "*"
    assert "X-Amz-Expires=900" in store.presign_get("runs/r/0/n.bin")


@pytest.mark.asyncio
async def test_presigned_urls_work_against_seaweedfs(store: EmbeddedStore) -> None:
    endpoint = store.endpoint
    s3 = S3Store(
        endpoint_url=endpoint.endpoint_url,
        bucket=endpoint.bucket,
        access_key=endpoint.access_key,
        secret_key=endpoint.secret_key,
        region=endpoint.region,
    )
    assert s3._presigner is not None  # the fast signer is the one under test
    payload = b"presigned by coordinator.presign"
    sha = hashlib.sha256(payload).hexdigest()
    key = "presign-test/run 1/00000/n~0+a.bin"
    url, headers = s3.presign_put(key, len(payload), sha)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.put(url, data=payload, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
            async with http.put(url, data=payload, headers=headers) as resp:
                assert resp.status == 412  # write-once
            async with http.get(s3.presign_get(key)) as resp:
                assert resp.status == 200 and await resp.read() == payload
        info = await s3.head(key)
        assert info is not None and info.size == len(payload)
        assert info.sha256_b64 in (None, base64.b64encode(bytes.fromhex(sha)).decode())
        assert await s3.head(key + ".missing") is None
    finally:
        await s3.delete_keys([key])
        await s3.close()


@pytest.mark.asyncio
async def test_listing_is_presigned_and_paged_against_seaweedfs(
    store: EmbeddedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = store.endpoint
    access = {
        "endpoint_url": endpoint.endpoint_url,
        "bucket": endpoint.bucket,
        "access_key": endpoint.access_key,
        "region": endpoint.region,
    }
    s3 = S3Store(secret_key=endpoint.secret_key, **access)  # type: ignore[arg-type]
    assert s3._presigner is not None

    def no_boto3(**kwargs: Any) -> None:
        raise AssertionError("the listing went through boto3")

    monkeypatch.setattr(s3._client, "list_objects_v2", no_boto3)
    monkeypatch.setattr(storage, "LIST_PAGE_KEYS", 2)  # 5 objects: three pages
    folder = "list-test/run 1/00003/"
    names = ["a.bin", "n~0+a.bin", "nöde%20b.bin", "z z.bin", "sub/c.bin"]
    expected = {folder + name: 10 + i for i, name in enumerate(names)}
    for key, size in expected.items():
        await s3.put_bytes(key, bytes(size))
    await s3.put_bytes("list-test/run 1/00004/other.bin", b"x")  # another folder: not listed
    wrong = S3Store(secret_key="not-the-secret", **access)  # type: ignore[arg-type]
    try:
        assert await s3.sizes(folder) == expected
        assert await s3.sizes("list-test/nothing-here/") == {}
        with pytest.raises(StorageError) as refused:
            await wrong.sizes(folder)
        assert not refused.value.unreachable  # the confirmer then HEADs instead (confirm.py)
    finally:
        await s3.delete_prefix("list-test/")
        await s3.close()
        await wrong.close()


NS = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"<html>a proxy's error page</html>",
        f"<ListBucketResult {NS}><Contents><Key>k</Key></Contents></ListBucketResult>".encode(),
        f"<ListBucketResult {NS}><Contents><Key>k</Key><Size>x</Size></Contents>"
        "</ListBucketResult>".encode(),
        f"<ListBucketResult {NS}><IsTruncated>true</IsTruncated></ListBucketResult>".encode(),
    ],
)
def test_an_answer_that_is_not_a_listing_is_a_storage_error(body: bytes) -> None:
    with pytest.raises(StorageError, match="not a listing"):
        parse_list_page(body)


def test_a_listing_page_decodes_its_keys() -> None:
    body = (
        f"<ListBucketResult {NS}><EncodingType>url</EncodingType><Contents><Key>r+1/n%7E%2B.bin"
        "</Key><Size>7</Size></Contents><IsTruncated>true</IsTruncated>"
        "<NextContinuationToken>t+1</NextContinuationToken></ListBucketResult>"
    ).encode()
    page = parse_list_page(body)
    assert page.sizes == {"r 1/n~+.bin": 7} and page.next_token == "t+1"
