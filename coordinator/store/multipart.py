"""Multipart uploads on the coordinator's side: create, presign each part, complete, abort.

A node uploads a large object in parts (``protocol.parts`` says why and how). The coordinator
holds the store's credentials, so it does what needs them:

- ``create`` starts a multipart upload at the caller's key (``ChecksumAlgorithm=SHA256``: the
  store keeps each part's sha256 and checks it at completion);
- ``presign_part`` signs one ``UploadPart`` URL bound to its part number, its length and its
  sha256. Measured on SeaweedFS 4.48: another length is refused (403, the signature), another
  body of the signed length is refused (400 ``BadDigest``), a dropped checksum header, another
  part number or an expired URL get 403. So a grant lets its holder write exactly the parts it
  announced, at its own key, and nothing else;
- ``complete`` sends ``CompleteMultipartUpload`` with ``If-None-Match: *``: SeaweedFS answers
  412 when the key already holds an object (measured: the first object stays), so the key stays
  write-once. Without that header SeaweedFS would replace the object, even by completing the
  same upload id a second time: the header is left out only where the store refuses
  completions that carry it (``coordinator.store.promises``). For a store that ignores it, a
  HEAD before the completion refuses a key that already holds an object (what is left is the
  race of two completions at once, and only the key's own node, or its checkpoint's grant
  holder, may complete anything there);
- ``abort_stale`` aborts uploads started longer ago than a grant lives (a node that crashed or
  took a fresh grant leaves its parts behind); retention calls it on every pass.

The whole object's sha256 cannot be checked by the store here (it keeps a digest of the parts'
digests, ``…-N``): every node that downloads the object checks size and sha256 against the
signed manifest, as for every payload, and the coordinator reads a checkpoint back before it
commits it (``coordinator.store.verify``). boto3 is blocking: every call runs on a thread,
presigning too (``coordinator.store.presign`` signs a part in microseconds where it agrees with
boto3, which takes about a millisecond; a 1 GB object has 128 parts, a large checkpoint thousands).
Errors leave as ``coordinator.base.errors.StorageError``, or ``Conflict`` for an upload the store
will not complete (a part missing, an unknown upload id): the node then uploads again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from coordinator.base.errors import Conflict, StorageError
from coordinator.store.object_store import sha256_b64, unless_missing
from protocol.parts import CompletedPart, PartPlan, PartUrl, part_ranges

log = logging.getLogger("sparseloco.coordinator.multipart")

#: Store error codes of a completion that already happened, or of a key that exists.
EXISTS = frozenset({"PreconditionFailed", "412"})
#: Store error codes of an upload the store will not complete as asked: the node starts over.
#: ``BadDigest``: a part's sha256 in the completion is not the one it was uploaded with
#: (SeaweedFS checks them, measured).
INCOMPLETE = frozenset(
    {
        "NoSuchUpload",
        "InvalidPart",
        "InvalidPartOrder",
        "EntityTooSmall",
        "InvalidRequest",
        "BadDigest",
    }
)


@runtime_checkable
class PartStore(Protocol):
    """What the coordinator needs of a store for multipart uploads."""

    async def create(self, key: str) -> str:
        """Start a multipart upload at ``key``; its upload id."""
        ...

    async def presign_parts(
        self, key: str, upload_id: str, size: int, plan: PartPlan
    ) -> list[PartUrl]:
        """One presigned ``UploadPart`` per part of ``plan``, bound to its length and sha256."""
        ...

    async def complete(self, key: str, upload_id: str, parts: list[CompletedPart]) -> bool:
        """Complete the upload, write-once; False if ``key`` already held an object."""
        ...

    async def abort_stale(self, prefix: str, older_than_s: float) -> int:
        """Abort the uploads under ``prefix`` started more than ``older_than_s`` ago; how many."""
        ...


Runner = Callable[[str, Callable[[], Any]], Awaitable[Any]]
#: (key, upload id, part number, size, sha256 hex) -> the part's URL and its exact headers.
PartSigner = Callable[[str, str, int, int, str], tuple[str, dict[str, str]]]


class S3Parts:
    """``PartStore`` on boto3: ``client`` for ``bucket``, each call through ``run`` (which
    puts it on a thread and translates botocore's errors, ``S3Store.run``); part URLs from
    ``sign`` (``S3Store.presign_part``: the fast SigV4 signer where it agrees with boto3).
    ``conditional()``: whether a completion carries ``If-None-Match: *`` (False for a store
    that refuses completions with it; the HEAD before the completion still guards the key);
    ``checksums()``: whether parts carry their sha256 (False for a store that refuses it)."""

    def __init__(
        self,
        client: Any,
        bucket: str,
        run: Runner,
        sign: PartSigner,
        conditional: Callable[[], bool] = lambda: True,
        checksums: Callable[[], bool] = lambda: True,
    ) -> None:
        self.client = client
        self.bucket = bucket
        self.run = run
        self.sign = sign
        self.conditional = conditional
        self.checksums = checksums

    async def create(self, key: str) -> str:
        resp = await self.run(
            f"create upload {key}",
            lambda: self.client.create_multipart_upload(
                Bucket=self.bucket, Key=key, **self._algorithm()
            ),
        )
        upload_id: str = resp["UploadId"]
        return upload_id

    async def presign_parts(
        self, key: str, upload_id: str, size: int, plan: PartPlan
    ) -> list[PartUrl]:
        def sign() -> list[PartUrl]:
            ranges = part_ranges(size, plan.part_size)
            return [
                PartUrl(number=n, url=url, headers=headers)
                for n, ((start, end), sha) in enumerate(zip(ranges, plan.sha256, strict=True), 1)
                for url, headers in [self.sign(key, upload_id, n, end - start, sha)]
            ]

        result: list[PartUrl] = await self.run(f"presign parts {key}", sign)
        return result

    async def complete(self, key: str, upload_id: str, parts: list[CompletedPart]) -> bool:
        # Write-once twice over: an object already there is never replaced, whether or not a
        # store honours If-None-Match on the completion (SeaweedFS 4.48 does, measured).
        if await self._exists(key):
            return False
        sums = self.checksums()
        listed = [
            {"PartNumber": p.number, "ETag": p.etag}
            | ({"ChecksumSHA256": sha256_b64(p.sha256)} if sums else {})
            for p in parts
        ]
        once = {"IfNoneMatch": "*"} if self.conditional() else {}
        try:
            await self.run(
                f"complete upload {key}",
                lambda: self.client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": listed},
                    **once,
                ),
            )
        except StorageError as exc:
            if exc.code in EXISTS:
                return False
            if exc.code in INCOMPLETE:
                raise Conflict(
                    "upload_incomplete",
                    f"the store would not complete this upload ({exc.code}); upload again",
                ) from exc
            raise
        return True

    def _algorithm(self) -> dict[str, str]:
        """A new upload's checksum algorithm: SHA256, unless the store refuses checksums."""
        return {"ChecksumAlgorithm": "SHA256"} if self.checksums() else {}

    async def _exists(self, key: str) -> bool:
        head = functools.partial(self.client.head_object, Bucket=self.bucket, Key=key)
        return await unless_missing(self.run(f"head {key}", head)) is not None

    async def abort_stale(self, prefix: str, older_than_s: float) -> int:
        def list_stale() -> list[tuple[str, str]]:
            stale = []
            cutoff = time.time() - older_than_s
            pages = self.client.get_paginator("list_multipart_uploads")
            for page in pages.paginate(Bucket=self.bucket, Prefix=prefix):
                for upload in page.get("Uploads") or []:
                    if upload["Initiated"].timestamp() < cutoff:
                        stale.append((upload["Key"], upload["UploadId"]))
            return stale

        stale: list[tuple[str, str]] = await self.run(f"list uploads {prefix}", list_stale)
        for key, upload_id in stale:
            try:
                await self.run(
                    f"abort upload {key}",
                    functools.partial(
                        self.client.abort_multipart_upload,
                        Bucket=self.bucket,
                        Key=key,
                        UploadId=upload_id,
                    ),
                )
            except StorageError as exc:
                if exc.code != "NoSuchUpload":  # aborted or completed meanwhile
                    raise
            log.info("event=upload_aborted key=%s", key)
        return len(stale)
