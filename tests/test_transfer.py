"""Presigned transfers against the real embedded SeaweedFS (no mock).

The URLs are presigned here with boto3 exactly as the coordinator does, so these tests pin what
the node relies on: the signed size and checksum are enforced, the key is write-once, ranged
downloads reassemble large objects, and digest checks catch a wrong object.
"""

from __future__ import annotations

import base64
import hashlib

import aiohttp
import pytest

from node.daemon.ratelimit import Limits
from node.daemon.retry import RetryPolicy
from node.daemon.transfer import get_object, put_object
from node.errors import DigestError, TransferError

pytestmark = pytest.mark.asyncio

FAST = RetryPolicy(attempts=2, base_s=0.01, budget_s=5.0)


def _presign_put(s3, bucket: str, key: str, body: bytes) -> tuple[str, dict[str, str]]:
    checksum = base64.b64encode(hashlib.sha256(body).digest()).decode()
    url = s3.generate_presigned_url(
        "put_object",
        Params={
            "Bucket": bucket,
            "Key": key,
            "ContentLength": len(body),
            "ChecksumSHA256": checksum,
            "IfNoneMatch": "*",
        },
        ExpiresIn=60,
    )
    headers = {
        "Content-Length": str(len(body)),
        "x-amz-checksum-sha256": checksum,
        "If-None-Match": "*",
    }
    return url, headers


def _presign_get(s3, bucket: str, key: str) -> str:
    return s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key})


async def test_put_then_get_and_write_once(store, s3, request) -> None:
    bucket = store.bucket
    key = f"transfer/{request.node.name}.slc"
    body = bytes(range(256)) * 40
    url, headers = _presign_put(s3, bucket, key, body)
    async with aiohttp.ClientSession() as http:
        assert await put_object(http, url, headers, body, policy=FAST) is True
        # The same upload again (a retry after a lost response) is harmless: 412 -> False.
        assert await put_object(http, url, headers, body, policy=FAST) is False
        got = await get_object(
            http,
            _presign_get(s3, bucket, key),
            size=len(body),
            sha256=hashlib.sha256(body).hexdigest(),
            policy=FAST,
        )
    assert got == body


async def test_signed_size_and_checksum_are_enforced(store, s3, request) -> None:
    bucket = store.bucket
    key = f"transfer/{request.node.name}.slc"
    body = b"the payload that was announced"
    url, headers = _presign_put(s3, bucket, key, body)
    async with aiohttp.ClientSession() as http:
        forged = b"another payload, same length!!"
        assert len(forged) == len(body)
        with pytest.raises(TransferError) as err:
            await put_object(http, url, headers, forged, policy=FAST)
        assert err.value.status is not None and 400 <= err.value.status < 500
        longer = dict(headers, **{"Content-Length": str(len(body) + 1)})
        with pytest.raises(TransferError):
            await put_object(http, url, longer, body + b"!", policy=FAST)
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix=key)


async def test_ranged_download_of_a_large_object(store, s3, request) -> None:
    bucket = store.bucket
    key = f"transfer/{request.node.name}.bin"
    body = hashlib.sha256(b"seed").digest() * 5000  # 160 kB
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    async with aiohttp.ClientSession() as http:
        got = await get_object(
            http,
            _presign_get(s3, bucket, key),
            size=len(body),
            sha256=hashlib.sha256(body).hexdigest(),
            policy=FAST,
            part_size=16_384,  # ten ranged parts
        )
    assert got == body


async def test_digest_and_size_mismatch_are_errors(store, s3, request) -> None:
    bucket = store.bucket
    key = f"transfer/{request.node.name}.bin"
    body = b"x" * 1000
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    url = _presign_get(s3, bucket, key)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(DigestError, match="sha256"):
            await get_object(http, url, size=1000, sha256="0" * 64, policy=FAST)
        with pytest.raises(DigestError, match="bytes"):
            await get_object(
                http, url, size=999, sha256=hashlib.sha256(body).hexdigest(), policy=FAST
            )
        missing = _presign_get(s3, bucket, key + ".missing")
        with pytest.raises(TransferError) as err:
            await get_object(http, missing, size=1, sha256="0" * 64, policy=FAST)
        assert err.value.status == 404


async def test_capped_transfers_move_the_same_bytes(store, s3, request) -> None:
    """A capped upload declares its length (a presigned PUT refuses a chunked body) and a
    capped download, plain or ranged, reassembles the object."""
    bucket = store.bucket
    key = f"transfer/{request.node.name}.slc"
    body = hashlib.sha256(b"capped").digest() * 10_000  # 320 kB, several chunks
    url, headers = _presign_put(s3, bucket, key, body)
    limits = Limits(upload=50e6, download=50e6)
    async with aiohttp.ClientSession() as http:
        assert await put_object(http, url, headers, body, policy=FAST, bandwidth=limits.upload)
        for part_size in (len(body), 100_000):
            got = await get_object(
                http,
                _presign_get(s3, bucket, key),
                size=len(body),
                sha256=hashlib.sha256(body).hexdigest(),
                policy=FAST,
                part_size=part_size,
                bandwidth=limits.download,
            )
            assert got == body
