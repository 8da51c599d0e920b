"""The object store's boto3 backend: ``S3Store``, the coordinator's ``ObjectStore``.

What the coordinator asks of a store is ``coordinator.store.object_store``. boto3 is blocking,
so every call that talks to the network runs in a thread executor; presigning is local
computation.

The HEAD that checks a submission and the listing that confirms a round's submissions are the
exceptions: ``head`` and ``sizes`` presign them and send them with aiohttp on the event loop, at
a fraction of boto3's CPU (``coordinator.store.head``); ``sizes`` goes through boto3 where the
fast signer is not used (below).

Presigned URLs (an upload grant, a manifest's downloads, that HEAD and listing) are signed by
``coordinator.store.presign`` once it has shown, when the store is built, that it gives exactly
the URLs boto3 gives for this endpoint; boto3 signs them otherwise. Both are local computation.

Every call's outcome goes to ``link`` (``protocol.links``): an outage of the store reads as one
WARNING when it stops answering and one line when it is back, whatever retries the publisher,
the retention and the handlers make meanwhile (each of theirs then only at DEBUG).

This is the only module that imports boto3 or botocore: every error of theirs leaves ``S3Store``
as ``coordinator.base.errors.StorageError`` (with the store's error code in ``.code``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from coordinator.base.errors import StorageError, TooLarge
from coordinator.store.head import PresignedSender
from coordinator.store.object_store import (
    READ_CHUNK,
    Consumer,
    ObjectInfo,
    sha256_b64,
    unless_missing,
)
from coordinator.store.presign import (
    BucketAccess,
    Request,
    SigV4Presigner,
    get_request,
    head_request,
    list_request,
    matches_botocore,
    part_request,
    put_request,
)
from coordinator.store.promises import StoreProfile
from protocol.causes import cause
from protocol.links import Link

log = logging.getLogger("sparseloco.coordinator.storage")

#: Seconds for one store request (connect and read) before it counts as failed.
STORE_TIMEOUT_S = 20.0
#: Most keys one DeleteObjects request may name (the S3 limit).
DELETE_BATCH = 1000
#: Seconds a HEAD's presigned URL is valid (it is sent at once).
HEAD_EXPIRY_S = 60
#: Seconds a listing page's presigned URL is valid (it is sent at once).
LIST_EXPIRY_S = 60
#: Keys a listing page asks for (the S3 limit).
LIST_PAGE_KEYS = 1000
#: The prefix a listing is checked with (characters a run's folder may hold).
PROBE_PREFIX = "presign-check/run 1/00000/"
#: The key the presigner is checked against boto3 with (characters a key may hold).
PROBE_KEY = "presign-check/run 1/00000/node_a-~+%.bin"
#: The upload id it is checked with (characters an upload id may hold).
PROBE_UPLOAD_ID = "3f2a_9b+c/d=e~f.g-h"


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
        #: What the store was seen to do (``adopt``): which headers a grant binds, how keys are
        #: named. Until a check says otherwise, every promise is taken as kept.
        self.profile = StoreProfile()
        #: Whether the store answers; logs once when it stops, once when it is back.
        self.link = Link("store", logger=log)
        #: Sends ``head``'s HEADs and ``sizes``' listing pages, presigned, on the event loop.
        self._sender = PresignedSender(self.link, STORE_TIMEOUT_S)
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
        self._fast = SigV4Presigner(
            BucketAccess(endpoint_url, bucket, access_key, secret_key, region=region)
        )
        #: The fast signer, or ``None`` when it does not sign as boto3 does for this endpoint.
        self._presigner = self._fast if self._agrees(self._fast) else None

    def adopt(self, profile: StoreProfile) -> None:
        """Work with ``profile`` from now on (``coordinator.store.conformance`` found it): the
        headers of every grant follow it, and the fast signer is checked against boto3 again
        for the requests it now makes."""
        self.profile = profile
        self._presigner = self._fast if self._agrees(self._fast) else None

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
            (self.put_request(key, 1, checksum), self.expiry_s),
            (get_request(key), self.expiry_s),
            (head_request(key), HEAD_EXPIRY_S),
            (self.part_request(key, PROBE_UPLOAD_ID, 7, 1, checksum), self.expiry_s),
            (list_request(PROBE_PREFIX, PROBE_UPLOAD_ID), LIST_EXPIRY_S),
        ]
        for r, expires_s in cases:
            url = self._boto_url(r, expires_s)
            if not matches_botocore(presigner, url, r.method, r.key, expires_s, r.headers, r.query):
                log.warning(
                    "event=presign_fallback reason=%s",
                    f"the SigV4 signer disagrees with boto3 on {r.operation}; boto3 signs",
                )
                return False
        return True

    def put_request(self, key: str, size: int, checksum: str) -> Request:
        """A grant's PUT as this store's profile wants it (``checksum``: sha256, base64)."""
        p = self.profile
        bound = checksum if p.checksum_header else None
        return put_request(key, size, bound, once=p.put_header, sdk=p.sdk_checksum)

    def part_request(
        self, key: str, upload_id: str, number: int, size: int, checksum: str
    ) -> Request:
        """A grant's part as this store's profile wants it (``checksum``: sha256, base64)."""
        p = self.profile
        bound = checksum if p.checksum_header else None
        return part_request(key, upload_id, number, size, bound, sdk=p.sdk_checksum)

    def presign(self, request: Request, expires_s: int) -> str:
        """``request``'s URL, valid ``expires_s`` seconds (the store check's probes)."""
        return self._sign(request, expires_s)

    def presign_lapsed(self, request: Request) -> str | None:
        """``request``'s URL as signed a minute ago for a second (the store check's expired URL),
        or None where boto3 signs (it signs only now)."""
        if self._presigner is None:
            return None
        r = request
        now = time.time() - 60
        return self._presigner.presign(r.method, r.key, 1, r.headers, now=now, query=r.query)

    def presign_put(self, key: str, size: int, sha256_hex: str) -> tuple[str, dict[str, str]]:
        request = self.put_request(key, size, sha256_b64(sha256_hex))
        return self._sign(request, self.expiry_s), dict(request.headers or {})

    def presign_part(
        self, key: str, upload_id: str, number: int, size: int, sha256_hex: str
    ) -> tuple[str, dict[str, str]]:
        """A URL and the exact headers for part ``number`` of multipart upload ``upload_id``:
        ``size`` bytes hashing to ``sha256_hex`` (``coordinator.store.multipart``)."""
        request = self.part_request(key, upload_id, number, size, sha256_b64(sha256_hex))
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
        """A presigned HEAD sent with aiohttp (``coordinator.store.head``); ``None`` on 404."""
        request = head_request(key)
        url = self._sign(request, HEAD_EXPIRY_S)
        return await self._sender.head(key, url, dict(request.headers or {}))

    async def close(self) -> None:
        """Close the HTTP session of ``head`` and ``sizes`` (the app's shutdown)."""
        await self._sender.close()

    def _body(self, key: str, max_size: int) -> Any:
        """The streaming body of ``key`` (a blocking call: on a thread); ``TooLarge`` if the store
        says it holds more than ``max_size`` bytes. The caller closes it."""
        resp = self._client.get_object(Bucket=self.bucket, Key=key)
        body = resp["Body"]
        if int(resp.get("ContentLength", 0)) > max_size:
            body.close()
            raise _too_large(key, max_size)
        return body

    async def get_bytes(self, key: str, max_size: int) -> bytes | None:
        def read() -> bytes:
            body = self._body(key, max_size)
            try:
                data: bytes = body.read(max_size + 1)
            finally:
                body.close()
            if len(data) > max_size:
                raise _too_large(key, max_size)
            return data

        result: bytes | None = await unless_missing(self._run(f"get {key}", read))
        return result

    async def read_chunks(
        self, key: str, max_size: int, consume: Consumer, *, chunk_bytes: int = READ_CHUNK
    ) -> bool:
        def read() -> bool:
            body = self._body(key, max_size)
            try:
                seen = 0
                # One byte past the limit is enough to know: a store that sends more than its
                # Content-Length said cannot make us read (or hash) more than that.
                while chunk := body.read(min(chunk_bytes, max_size + 1 - seen)):
                    seen += len(chunk)
                    if seen > max_size:
                        raise _too_large(key, max_size)
                    consume(chunk)
            finally:
                body.close()
            return True

        return await unless_missing(self._run(f"get {key}", read)) is not None

    async def put_bytes(self, key: str, data: bytes) -> None:
        await self._call(
            f"put {key}", "put_object", Key=key, Body=data, ContentType="application/json"
        )

    async def delete_keys(self, keys: list[str]) -> int:
        if not self.profile.multi_delete:  # one DELETE per key (GCS's XML API, for one)
            for key in keys:
                await self._call(f"delete {key}", "delete_object", Key=key)
            return len(keys)
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

    async def sizes(self, prefix: str) -> dict[str, int]:
        found: dict[str, int] = {}
        token: str | None = None
        while self._presigner is not None:  # presigned, parsed here (``coordinator.store.head``)
            url = self._sign(list_request(prefix, token, LIST_PAGE_KEYS), LIST_EXPIRY_S)
            page = await self._sender.list_page(prefix, url)
            found.update(page.sizes)
            if page.next_token is None:
                return found
            token = page.next_token
        while True:
            extra = {} if token is None else {"ContinuationToken": token}
            resp = await self._call(f"list {prefix}", "list_objects_v2", Prefix=prefix, **extra)
            found.update((obj["Key"], int(obj["Size"])) for obj in resp.get("Contents") or [])
            if not resp.get("IsTruncated"):
                return found
            token = resp["NextContinuationToken"]

    async def delete_prefix(self, prefix: str) -> int:
        return await self.delete_keys(list(await self.sizes(prefix)))


def _too_large(key: str, max_size: int) -> TooLarge:
    return TooLarge(f"{key} holds more than {max_size} bytes", "size")
