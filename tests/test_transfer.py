"""Presigned transfers against the real embedded SeaweedFS (no mock).

The URLs are presigned here with boto3 exactly as the coordinator does, so these tests pin what
the node relies on: the signed size and checksum are enforced, the key is write-once, ranged
downloads reassemble large objects, and digest checks catch a wrong object; and the same for
objects streamed to and from local files (``get_to_file``, ``put_file``), which must never hold
the object in memory nor leave a file behind that does not check out.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from node.daemon.filestream import body_to_file
from node.daemon.ratelimit import CHUNK, Bandwidth, Limits
from node.daemon.retry import RetryPolicy
from node.daemon.transfer import get_object, get_to_file, put_file, put_object
from node.daemon.transferopts import TransferOptions
from node.errors import DigestError, TransferError

pytestmark = pytest.mark.asyncio

FAST = RetryPolicy(attempts=2, base_s=0.01, budget_s=5.0)
#: A transfer with the quick retries and nothing else set.
FAST_OPTIONS = TransferOptions(policy=FAST)


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
        assert await put_object(http, url, headers, body, options=FAST_OPTIONS) is True
        # The same upload again (a retry after a lost response) is harmless: 412 -> False.
        assert await put_object(http, url, headers, body, options=FAST_OPTIONS) is False
        got = await get_object(
            http,
            _presign_get(s3, bucket, key),
            size=len(body),
            sha256=hashlib.sha256(body).hexdigest(),
            options=FAST_OPTIONS,
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
            await put_object(http, url, headers, forged, options=FAST_OPTIONS)
        assert err.value.status is not None and 400 <= err.value.status < 500
        longer = dict(headers, **{"Content-Length": str(len(body) + 1)})
        with pytest.raises(TransferError):
            await put_object(http, url, longer, body + b"!", options=FAST_OPTIONS)
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
            part_size=16_384,  # ten ranged parts
            options=FAST_OPTIONS,
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
            await get_object(http, url, size=1000, sha256="0" * 64, options=FAST_OPTIONS)
        with pytest.raises(DigestError, match="bytes"):
            await get_object(
                http, url, size=999, sha256=hashlib.sha256(body).hexdigest(), options=FAST_OPTIONS
            )
        missing = _presign_get(s3, bucket, key + ".missing")
        with pytest.raises(TransferError) as err:
            await get_object(http, missing, size=1, sha256="0" * 64, options=FAST_OPTIONS)
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
        assert await put_object(
            http, url, headers, body, options=TransferOptions(policy=FAST, bandwidth=limits.upload)
        )
        for part_size in (len(body), 100_000):
            got = await get_object(
                http,
                _presign_get(s3, bucket, key),
                size=len(body),
                sha256=hashlib.sha256(body).hexdigest(),
                part_size=part_size,
                options=TransferOptions(policy=FAST, bandwidth=limits.download),
            )
            assert got == body


def _sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def test_files_up_and_down_plain_ranged_and_capped(store, s3, request, tmp_path) -> None:
    """A file goes up streamed from disk (write-once: the repeat answers False) and comes back
    to a file in one GET, in ranged parts and under caps, byte for byte, with nothing else left
    in the folder."""
    bucket = store.bucket
    key = f"transfer/{request.node.name}.safetensors"
    body = hashlib.sha256(b"file").digest() * 10_000 + b"tail"  # 320 kB, not a whole part
    source = tmp_path / "up" / "model.safetensors"
    source.parent.mkdir()
    source.write_bytes(body)
    url, headers = _presign_put(s3, bucket, key, body)
    limits = Limits(upload=50e6, download=50e6)
    async with aiohttp.ClientSession() as http:
        assert await put_file(http, url, headers, source, size=len(body), options=FAST_OPTIONS)
        assert not await put_file(
            http,
            url,
            headers,
            source,
            size=len(body),
            options=TransferOptions(policy=FAST, bandwidth=limits.upload),
        )
        down = tmp_path / "down"
        down.mkdir()
        for part_size, cap in ((len(body), None), (50_000, None), (100_000, limits.download)):
            target = down / f"{part_size}.safetensors"
            await get_to_file(
                http,
                _presign_get(s3, bucket, key),
                target,
                size=len(body),
                sha256=_sha(body),
                part_size=part_size,
                options=TransferOptions(policy=FAST, bandwidth=cap),
            )
            assert target.read_bytes() == body
    assert _leftovers(down) == ["100000.safetensors", "320004.safetensors", "50000.safetensors"]


class Metered(Bandwidth):
    """A cap too high to slow anything, noting every piece the transfers ask it for."""

    def __init__(self) -> None:
        super().__init__(1e12)
        self.taken: list[int] = []

    async def take(self, n: int) -> None:
        self.taken.append(n)
        await super().take(n)


async def test_capped_file_transfers_pass_every_byte_through_the_cap(
    store, s3, request, tmp_path
) -> None:
    bucket = store.bucket
    key = f"transfer/{request.node.name}.bin"
    body = os.urandom(300_000)
    source = tmp_path / "body.bin"
    source.write_bytes(body)
    url, headers = _presign_put(s3, bucket, key, body)
    async with aiohttp.ClientSession() as http:
        up = Metered()
        assert await put_file(
            http, url, headers, source, size=len(body), options=TransferOptions(bandwidth=up)
        )
        assert sum(up.taken) == len(body) and max(up.taken) <= CHUNK
        for part_size in (len(body), 64_000):
            down = Metered()
            target = tmp_path / f"down-{part_size}.bin"
            await get_to_file(
                http, _presign_get(s3, bucket, key), target, size=len(body), sha256=_sha(body),
                part_size=part_size, options=TransferOptions(bandwidth=down),
            )  # fmt: skip
            assert target.read_bytes() == body
            assert sum(down.taken) == len(body) and max(down.taken) <= CHUNK


async def test_a_failed_part_is_fetched_again_alone(store, s3, request, tmp_path) -> None:
    """The first GET of one part asks for a range shifted by a byte (wrong bytes, one short):
    that part alone is fetched again and overwrites what it wrote; the file checks out."""
    bucket = store.bucket
    key = f"transfer/{request.node.name}.bin"
    body = os.urandom(100_000)
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    async with aiohttp.ClientSession() as http:
        flaky = ShiftedOnce(http, "bytes=40000-59999")
        target = tmp_path / "model.bin"
        await get_to_file(
            cast(aiohttp.ClientSession, flaky),
            _presign_get(s3, bucket, key),
            target,
            size=len(body),
            sha256=_sha(body),
            part_size=20_000,
            options=FAST_OPTIONS,
        )
    assert target.read_bytes() == body
    assert flaky.gets == {
        f"bytes={s}-{s + 19_999}": 2 if s == 40_000 else 1 for s in range(0, 100_000, 20_000)
    }


class ShiftedOnce:
    """A session whose first GET of range ``victim`` asks for one byte further on instead."""

    def __init__(self, http: aiohttp.ClientSession, victim: str) -> None:
        self.http = http
        self.victim = victim
        self.gets: Counter[str] = Counter()

    def get(self, url: Any, *, headers: dict[str, str], **kw: Any) -> Any:
        wanted = headers["Range"]
        self.gets[wanted] += 1
        if wanted == self.victim and self.gets[wanted] == 1:
            start, end = map(int, wanted.removeprefix("bytes=").split("-"))
            headers = {"Range": f"bytes={start + 1}-{end}"}
        return self.http.get(url, headers=headers, **kw)


async def test_a_bad_download_leaves_no_file(store, s3, request, tmp_path) -> None:
    """Wrong sha256, wrong size, a missing object, a cancelled download: ``DigestError`` or
    ``TransferError``, and neither the file nor its temporary is left behind."""
    bucket = store.bucket
    key = f"transfer/{request.node.name}.bin"
    body = os.urandom(300_000)
    s3.put_object(Bucket=bucket, Key=key, Body=body)
    url = _presign_get(s3, bucket, key)
    target = tmp_path / "model.bin"
    async with aiohttp.ClientSession() as http:
        for part_size in (len(body), 64_000):
            with pytest.raises(DigestError, match="sha256"):
                await get_to_file(
                    http,
                    url,
                    target,
                    size=len(body),
                    sha256="0" * 64,
                    part_size=part_size,
                    options=FAST_OPTIONS,
                )
        with pytest.raises(DigestError, match="bytes"):
            await get_to_file(
                http, url, target, size=len(body) - 1, sha256=_sha(body), options=FAST_OPTIONS
            )
        with pytest.raises(TransferError) as err:
            missing = _presign_get(s3, bucket, key + ".missing")
            await get_to_file(http, missing, target, size=1, sha256="0" * 64, options=FAST_OPTIONS)
        assert err.value.status == 404
        slow = Limits(download=100e3).download  # 3 s for the object: cancelled long before
        download = get_to_file(
            http,
            url,
            target,
            size=len(body),
            sha256=_sha(body),
            part_size=64_000,
            options=TransferOptions(policy=FAST, bandwidth=slow),
        )
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(download, 0.3)
    assert _leftovers(tmp_path) == []


async def test_files_are_streamed_not_held(store, s3, request, tmp_path) -> None:
    """A 32 MB object goes up and comes down (in parts) with a few MB of Python memory at most."""
    bucket = store.bucket
    key = f"transfer/{request.node.name}.bin"
    body = os.urandom(32 << 20)
    source = tmp_path / "up.bin"
    source.write_bytes(body)
    sha = _sha(body)
    url, headers = _presign_put(s3, bucket, key, body)
    del body
    async with aiohttp.ClientSession() as http:
        tracemalloc.start()
        try:
            assert await put_file(http, url, headers, source, size=32 << 20, options=FAST_OPTIONS)
            _, peak_up = tracemalloc.get_traced_memory()
            tracemalloc.reset_peak()
            target = tmp_path / "down.bin"
            await get_to_file(
                http,
                _presign_get(s3, bucket, key),
                target,
                size=32 << 20,
                sha256=sha,
                options=FAST_OPTIONS,
            )
            _, peak_down = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert _sha(target.read_bytes()) == sha
    # A piece of each part in flight and the stream's buffers, not the object.
    assert peak_up < 8 << 20 and peak_down < 14 << 20, (peak_up, peak_down)


async def test_an_upload_of_a_file_of_another_size_is_refused(store, s3, request, tmp_path) -> None:
    body = b"the checkpoint"
    source = tmp_path / "model.safetensors"
    source.write_bytes(body)
    url, headers = _presign_put(s3, store.bucket, f"transfer/{request.node.name}", body)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(TransferError, match="holds 14 bytes, not 15"):
            await put_file(http, url, headers, source, size=15, options=FAST_OPTIONS)
        with pytest.raises(TransferError, match="cannot read"):
            await put_file(http, url, headers, tmp_path / "absent", size=14, options=FAST_OPTIONS)


class _Body:
    """A response whose body is ``data``, read in pieces of at most ``piece`` bytes."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.content = self
        self._data = data
        self._piece = piece

    async def read(self, n: int) -> bytes:
        out, self._data = self._data[: min(n, self._piece)], self._data[min(n, self._piece) :]
        return out


@pytest.mark.parametrize("extra", [0, 1, 500])
async def test_a_long_body_is_never_written_past_its_part(tmp_path, extra: int) -> None:
    """A part that runs long (a store ignoring the range) must not touch the next part's bytes."""
    path = tmp_path / "file"
    path.write_bytes(b"." * 30)
    fd = os.open(path, os.O_RDWR)
    try:
        got = await body_to_file(cast(Any, _Body(b"x" * (10 + extra), 3)), fd, 10, 10, None)
    finally:
        os.close(fd)
    assert got == 10 + min(extra, 1)  # one byte over is enough to know
    assert path.read_bytes() == b"." * 10 + b"x" * 10 + b"." * 10
