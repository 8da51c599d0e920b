"""The coordinator's seam to the object store: a small Protocol and its boto3 backend.

The coordinator never moves payloads itself. It presigns a PUT that only accepts the announced
size and sha256 and only once (``If-None-Match: *``), presigns GETs, checks uploads with HEAD,
writes the signed manifests and checkpoint sidecars, and deletes what the retention policy no
longer needs. The objects it reads back are an uploaded checkpoint, to verify it before it is
committed (``read_chunks``: streamed in bounded chunks to a consumer, never held whole), and a
dataset's small manifest (``get_bytes``); both are bounded by the caller's size limit. boto3 is
blocking, so every call that talks to the network runs in a thread executor; presigning is local
computation.

The HEAD that checks every submission is the exception: through boto3 it cost about three
times the CPU of a presigned HEAD sent with aiohttp on the event loop (botocore builds, signs and
parses every request in Python, on a thread that holds the interpreter lock while the loop
waits), and a round makes one per node. So ``head`` presigns and sends it itself, with the
same timeout and a few tries on the same transient errors.

Presigned URLs (an upload grant, a manifest's downloads, that HEAD) are signed by
``coordinator.store.presign`` once it has shown, when the store is built, that it gives exactly the
URLs boto3 gives for this endpoint; boto3 signs them otherwise. Both are local computation.

Every call's outcome goes to ``link`` (``protocol.links``): an outage of the store reads as one
WARNING when it stops answering and one line when it is back, whatever retries the publisher,
the retention and the handlers make meanwhile (each of theirs then only at DEBUG).

This is the only module that imports boto3 or botocore: every error of theirs leaves ``S3Store``
as ``coordinator.base.errors.StorageError`` (with the store's error code in ``.code``).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from coordinator.base.errors import StorageError, TooLarge
from coordinator.store.presign import (
    Request,
    SigV4Presigner,
    get_request,
    head_request,
    matches_botocore,
    part_request,
    put_request,
)
from protocol.causes import cause
from protocol.links import Link

log = logging.getLogger("sparseloco.coordinator.storage")

#: Seconds for one store request (connect and read) before it counts as failed.
STORE_TIMEOUT_S = 20.0
#: Most keys one DeleteObjects request may name (the S3 limit).
DELETE_BATCH = 1000
#: S3 error codes of a HEAD on a key that does not exist (AWS, MinIO, SeaweedFS, R2 differ).
NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound"})
#: Tries of one HEAD (boto3's "standard" retry mode makes as many) on a connection error or a
#: 5xx / 429 answer, with a short jittered pause between them.
HEAD_ATTEMPTS = 3
HEAD_RETRY_S = 0.2
_HEAD_TRANSIENT = frozenset({429, 500, 502, 503, 504})
#: Seconds a HEAD's presigned URL is valid (it is sent at once).
HEAD_EXPIRY_S = 60
#: Bytes ``read_chunks`` hands its consumer at a time (its memory, whatever the object's size).
READ_CHUNK = 1 << 20
#: The key the presigner is checked against boto3 with (characters a key may hold).
PROBE_KEY = "presign-check/run 1/00000/node_a-~+%.bin"
#: The upload id it is checked with (characters an upload id may hold).
PROBE_UPLOAD_ID = "3f2a_9b+c/d=e~f.g-h"


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    sha256_b64: str | None  # the stored checksum when the store keeps one


def sha256_b64(sha256_hex: str) -> str:
    """The base64 form of a hex sha256, as the ``x-amz-checksum-sha256`` header carries it."""
    return base64.b64encode(bytes.fromhex(sha256_hex)).decode()


def retry_logged(logger: logging.Logger, event: str, retry_in_s: float, exc: BaseException) -> None:
    """A background write that will be tried again. An unreachable store was logged once by its
    link (``S3Store.link``): each retry of it then only at DEBUG; a refusal (credentials, a
    full bucket) is a WARNING every time, with its cause in a few words."""
    logger.debug("event=%s retry_in_s=%.1f error=%r", event, retry_in_s, exc)
    if not getattr(exc, "unreachable", False):
        logger.warning("event=%s retry_in_s=%.1f cause=%r", event, retry_in_s, cause(exc))


class ObjectStore(Protocol):
    def presign_put(self, key: str, size: int, sha256_hex: str) -> tuple[str, dict[str, str]]:
        """A URL and the exact headers for one write of ``size`` bytes hashing to ``sha256``."""
        ...

    def presign_get(self, key: str) -> str: ...

    async def head(self, key: str) -> ObjectInfo | None:
        """Size and checksum of ``key``, or ``None`` if it does not exist."""
        ...

    async def put_bytes(self, key: str, data: bytes) -> None: ...

    async def get_bytes(self, key: str, max_size: int) -> bytes | None:
        """The whole object at ``key``, ``None`` if it does not exist; ``TooLarge`` (and no more
        than ``max_size + 1`` bytes read) if it holds more than ``max_size`` bytes."""
        ...

    async def read_chunks(
        self,
        key: str,
        max_size: int,
        consume: Callable[[bytes], None],
        *,
        chunk_bytes: int = READ_CHUNK,
    ) -> bool:
        """Stream the object at ``key`` to ``consume``, in order, in pieces of at most
        ``chunk_bytes``, off the event loop (``consume`` runs on that thread too); False if it
        does not exist. ``TooLarge`` (and no more than ``max_size + 1`` bytes read) if it holds
        more than ``max_size`` bytes; an exception of ``consume`` ends the read and propagates."""
        ...

    async def delete_keys(self, keys: list[str]) -> int:
        """Delete ``keys`` (absent ones are no error); how many were asked to go."""
        ...

    async def delete_prefix(self, prefix: str) -> int:
        """Delete every object whose key starts with ``prefix``; how many there were."""
        ...


class S3Store:
    """``ObjectStore`` on any S3-compatible endpoint through boto3 (SigV4 presigning)."""

    def __init__(
        self,
        *,
        endpoint_url: str,
        bucket: str,
        access_key: str,
        secret_key: str,
        region: str = "us-east-1",
        expiry_s: int = 900,
    ) -> None:
        self.bucket = bucket
        self.expiry_s = expiry_s
        #: Whether the store answers; logs once when it stops, once when it is back.
        self.link = Link("store", logger=log)
        self._http: aiohttp.ClientSession | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = boto3.client(
            "s3",
            endpoint_url=endpoint_url,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name=region,
            config=Config(
                signature_version="s3v4",
                connect_timeout=STORE_TIMEOUT_S,
                read_timeout=STORE_TIMEOUT_S,
                retries={"max_attempts": 3, "mode": "standard"},
            ),
        )
        presigner = SigV4Presigner(
            endpoint_url=endpoint_url,
            bucket=bucket,
            access_key=access_key,
            secret_key=secret_key,
            region=region,
        )
        #: The fast signer, or ``None`` when it does not sign as boto3 does for this endpoint.
        self._presigner = presigner if self._agrees(presigner) else None

    def _sign(self, request: Request, expires_s: int) -> str:
        """``request``'s URL, valid ``expires_s`` seconds: the fast signer's where it agrees
        with boto3 (checked at start), boto3's otherwise."""
        if self._presigner is not None:
            r = request
            return self._presigner.presign(r.method, r.key, expires_s, r.headers, query=r.query)
        return self._boto_url(request, expires_s)

    def _boto_url(self, request: Request, expires_s: int) -> str:
        """boto3's presigned URL of ``request`` on this bucket."""
        url: str = self._client.generate_presigned_url(
            request.operation, Params={"Bucket": self.bucket, **request.params}, ExpiresIn=expires_s
        )
        return url

    def _agrees(self, presigner: SigV4Presigner) -> bool:
        """Whether ``presigner`` gives boto3's URL for each kind of request made here."""
        key, checksum = PROBE_KEY, sha256_b64("00" * 32)
        cases = [
            (put_request(key, 1, checksum), self.expiry_s),
            (get_request(key), self.expiry_s),
            (head_request(key), HEAD_EXPIRY_S),
            (part_request(key, PROBE_UPLOAD_ID, 7, 1, checksum), self.expiry_s),
        ]
        for r, expires_s in cases:
            url = self._boto_url(r, expires_s)
            if not matches_botocore(presigner, url, r.method, key, expires_s, r.headers, r.query):
                log.warning(
                    "event=presign_fallback reason=%s",
                    f"the SigV4 signer disagrees with boto3 on {r.operation}; boto3 signs",
                )
                return False
        return True

    def presign_put(self, key: str, size: int, sha256_hex: str) -> tuple[str, dict[str, str]]:
        request = put_request(key, size, sha256_b64(sha256_hex))
        return self._sign(request, self.expiry_s), dict(request.headers or {})

    def presign_part(
        self, key: str, upload_id: str, number: int, size: int, sha256_hex: str
    ) -> tuple[str, dict[str, str]]:
        """A URL and the exact headers for part ``number`` of multipart upload ``upload_id``:
        ``size`` bytes hashing to ``sha256_hex`` (``coordinator.store.multipart``)."""
        request = part_request(key, upload_id, number, size, sha256_b64(sha256_hex))
        return self._sign(request, self.expiry_s), dict(request.headers or {})

    def presign_get(self, key: str) -> str:
        return self._sign(get_request(key), self.expiry_s)

    async def _call(self, what: str, method: str, **kwargs: Any) -> Any:
        """Run client ``method`` in a thread; any botocore error becomes ``StorageError``.

        ``what`` says what failed in the error's message (``"head {key}"``).
        """
        call = functools.partial(getattr(self._client, method), Bucket=self.bucket, **kwargs)
        return await self._run(what, call)

    @property
    def client(self) -> Any:
        """The boto3 client (``coordinator.store.multipart.S3Parts`` shares it, through ``run``)."""
        return self._client

    async def run(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` in a thread, as every call of this store is made (``_run``)."""
        return await self._run(what, call)

    async def _run(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` in a thread, its botocore errors as ``StorageError``; the outcome told to
        ``link`` (one log line when the store stops answering, one when it is back)."""
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(None, call)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", "")) or None
            failure = StorageError(f"{what}: {exc}", code=code)
            self._heard(what, failure, exc)
            raise failure from exc
        except BotoCoreError as exc:
            failure = StorageError(f"{what}: {cause(exc)}")
            self._heard(what, failure, exc)
            raise failure from exc
        self.link.answered()
        return result

    def _heard(self, what: str, failure: StorageError, exc: BaseException) -> None:
        """A failed call: an outage for the link, or an answer (a refusal, a missing key)."""
        if failure.unreachable:
            self.link.failed(what, exc)
        else:
            self.link.answered()

    async def check_bucket(self) -> None:
        """HEAD the bucket: ``StorageError`` (code ``404``, ``403``...) unless it is reachable."""
        await self._call(f"head bucket {self.bucket}", "head_bucket")

    async def head(self, key: str) -> ObjectInfo | None:
        """A presigned HEAD sent with aiohttp (see the module doc); ``None`` on 404."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http.closed or self._http_loop is not loop:
            # One session per event loop (a test may run the store under several loops).
            timeout = aiohttp.ClientTimeout(total=STORE_TIMEOUT_S)
            self._http, self._http_loop = aiohttp.ClientSession(timeout=timeout), loop
        request = head_request(key)
        headers = dict(request.headers or {})
        url = self._sign(request, HEAD_EXPIRY_S)
        for attempt in range(HEAD_ATTEMPTS):
            if attempt:
                await asyncio.sleep(HEAD_RETRY_S * (1 + random.random()) * attempt)
            try:
                async with self._http.head(url, headers=headers) as resp:
                    status = resp.status
                    size = resp.headers.get("Content-Length")
                    checksum = resp.headers.get("x-amz-checksum-sha256")
            except (aiohttp.ClientError, TimeoutError) as exc:
                # ``cause`` never quotes aiohttp's text: it may carry the presigned URL.
                failure = StorageError(f"head {key}: {cause(exc)}")
                self.link.failed(f"head {key}", exc)
                continue
            if status in _HEAD_TRANSIENT:
                failure = StorageError(f"head {key}: HTTP {status}", code=str(status))
                self.link.failed(f"head {key}", failure)
                continue
            self.link.answered()
            if status == 404:
                return None
            if status >= 300 or size is None:
                raise StorageError(f"head {key}: HTTP {status}", code=str(status))
            return ObjectInfo(size=int(size), sha256_b64=checksum)
        raise failure

    async def close(self) -> None:
        """Close the HTTP session of ``head`` (the app's shutdown)."""
        if self._http is not None:
            await self._http.close()

    async def get_bytes(self, key: str, max_size: int) -> bytes | None:
        def read() -> bytes:
            resp = self._client.get_object(Bucket=self.bucket, Key=key)
            body = resp["Body"]
            try:
                if int(resp.get("ContentLength", 0)) > max_size:
                    raise TooLarge(f"{key} holds more than {max_size} bytes", "size")
                data: bytes = body.read(max_size + 1)
            finally:
                body.close()
            if len(data) > max_size:
                raise TooLarge(f"{key} holds more than {max_size} bytes", "size")
            return data

        try:
            result: bytes = await self._run(f"get {key}", read)
        except StorageError as exc:
            if exc.code in NOT_FOUND:
                return None
            raise
        return result

    async def read_chunks(
        self,
        key: str,
        max_size: int,
        consume: Callable[[bytes], None],
        *,
        chunk_bytes: int = READ_CHUNK,
    ) -> bool:
        def read() -> None:
            resp = self._client.get_object(Bucket=self.bucket, Key=key)
            body = resp["Body"]
            try:
                if int(resp.get("ContentLength", 0)) > max_size:
                    raise TooLarge(f"{key} holds more than {max_size} bytes", "size")
                seen = 0
                # One byte past the limit is enough to know: a store that sends more than its
                # Content-Length said cannot make us read (or hash) more than that.
                while chunk := body.read(min(chunk_bytes, max_size + 1 - seen)):
                    seen += len(chunk)
                    if seen > max_size:
                        raise TooLarge(f"{key} holds more than {max_size} bytes", "size")
                    consume(chunk)
            finally:
                body.close()

        try:
            await self._run(f"get {key}", read)
        except StorageError as exc:
            if exc.code in NOT_FOUND:
                return False
            raise
        return True

    async def put_bytes(self, key: str, data: bytes) -> None:
        await self._call(
            f"put {key}", "put_object", Key=key, Body=data, ContentType="application/json"
        )

    async def delete_keys(self, keys: list[str]) -> int:
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start : start + DELETE_BATCH]
            objects = [{"Key": k} for k in batch]
            resp = await self._call(
                f"delete {batch[0]}...",
                "delete_objects",
                Delete={"Objects": objects, "Quiet": True},
            )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"delete {first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                    f" ({len(errors)} of {len(batch)} keys failed)",
                    code=first.get("Code"),
                )
        return len(keys)

    async def delete_prefix(self, prefix: str) -> int:
        keys: list[str] = []
        token: str | None = None
        while True:
            extra = {} if token is None else {"ContinuationToken": token}
            resp = await self._call(f"list {prefix}", "list_objects_v2", Prefix=prefix, **extra)
            keys += [obj["Key"] for obj in resp.get("Contents") or []]
            if not resp.get("IsTruncated"):
                break
            token = resp["NextContinuationToken"]
        return await self.delete_keys(keys)
