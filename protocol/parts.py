"""Objects that travel in parts: the multipart upload's wire models and the arithmetic of parts.

A payload of a large model (about 18 MB at 1 B parameters, 1.3 GB at 70 B) crosses a home uplink
in minutes; one dropped connection must cost one part, not the object. So an upload above
``node.daemon.multipart.MULTIPART_THRESHOLD`` is an S3 multipart upload:

1. the node cuts the object into parts of ``part_size`` bytes (the last one shorter) and asks
   for a grant with the sha256 of every part (``PartPlan`` in ``UploadRequest.parts``);
2. the coordinator, which holds the store's credentials, creates the multipart upload and
   answers a ``MultipartGrant``: one presigned ``UploadPart`` URL per part, each bound to its
   part number, its length (``Content-Length``) and its sha256 (``x-amz-checksum-sha256``),
   like the single PUT is for the whole object;
3. the node uploads the parts, a few at a time, each retried alone, and keeps each part's ETag;
4. it asks the coordinator to complete the upload (``UploadComplete``): the coordinator sends
   ``CompleteMultipartUpload`` with ``If-None-Match: *``, so the key stays write-once
   (``UploadDone.created`` is False when the object already existed, like a 412 on a PUT).

The whole object's sha256 is not something the store can check for a multipart upload (it
keeps the parts' digests, not the whole's); every downloader checks it against the signed
manifest, as it always has. The layout rules: every part but the last has exactly
``part_size`` bytes, at least ``MIN_PART_SIZE`` (S3's minimum, which SeaweedFS enforces too:
``EntityTooSmall``), and there are at most ``MAX_PARTS``.

This module is pure (pydantic models and integer arithmetic); ``protocol.messages`` embeds the
models in the upload request and grant.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

#: S3's smallest part (all but the last one).
MIN_PART_SIZE = 5 << 20
#: S3's largest part.
MAX_PART_SIZE = 5 << 30
#: S3's most parts of one upload.
MAX_PARTS = 10_000

#: Bytes of a request body that lists every part of the largest upload: a grant request names
#: a sha256 per part (about 67 bytes of JSON), a completion its number, ETag and sha256 (about
#: 140). The endpoints that take such a body accept this much, whatever the coordinator's
#: ``max_body_bytes`` for the others (``protocol.routes``, ``Endpoint.body_limit``).
MAX_PARTS_BODY_BYTES = MAX_PARTS * 160

PartDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
PartNumber = Annotated[int, Field(strict=True, ge=1, le=MAX_PARTS)]
#: An ETag as S3 answers it (a quoted hex MD5, or another store's opaque token).
ETag = Annotated[str, StringConstraints(pattern=r"^[\x21-\x7e]{1,128}$")]
#: An upload id as the store made it (opaque; SeaweedFS: hex and an underscore).
UploadId = Annotated[str, StringConstraints(pattern=r"^[\x21-\x7e]{1,1024}$")]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PartPlan(_Wire):
    """How a node cuts its object: the part size and every part's sha256, in order."""

    part_size: int = Field(strict=True, ge=MIN_PART_SIZE, le=MAX_PART_SIZE)
    sha256: list[PartDigest] = Field(min_length=1, max_length=MAX_PARTS)

    def fits(self, size: int) -> bool:
        """Whether these parts cut an object of ``size`` bytes."""
        return len(self.sha256) == part_count(size, self.part_size)


class PartUrl(_Wire):
    """One presigned ``UploadPart``: send exactly ``headers`` (size and sha256 of the part)."""

    number: PartNumber
    url: str
    headers: dict[str, str]


class MultipartGrant(_Wire):
    """A multipart upload created for the caller's key, with a presigned URL per part."""

    upload_id: UploadId
    part_size: int
    parts: list[PartUrl]


class CompletedPart(_Wire):
    """A part the store took: its number, the ETag it answered and the part's sha256."""

    number: PartNumber
    etag: ETag
    sha256: PartDigest


class UploadComplete(_Wire):
    """Ask the coordinator to complete a multipart upload of the caller's own key."""

    upload_id: UploadId
    parts: list[CompletedPart] = Field(min_length=1, max_length=MAX_PARTS)


class UploadDone(_Wire):
    """``created``: False if the key already held an object (write-once: nothing replaced)."""

    created: bool


def part_count(size: int, part_size: int) -> int:
    """How many parts an object of ``size`` bytes has."""
    return -(-size // part_size)


def part_ranges(size: int, part_size: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every part, in order (``end`` exclusive)."""
    return [(s, min(size, s + part_size)) for s in range(0, size, part_size)]


def part_digests(data: bytes | memoryview, part_size: int) -> list[str]:
    """The sha256 (hex) of every part of ``data``."""
    view = memoryview(data)
    return [hashlib.sha256(view[s:e]).hexdigest() for s, e in part_ranges(len(view), part_size)]


def composite_sha256_b64(digests: list[str]) -> str:
    """The checksum an S3 store keeps for an object uploaded in these parts (hex sha256 each):
    base64 of the sha256 of the parts' raw digests, then ``-`` and the number of parts."""
    joined = b"".join(bytes.fromhex(d) for d in digests)
    return f"{base64.b64encode(hashlib.sha256(joined).digest()).decode()}-{len(digests)}"


def parts_in_order(parts: list[CompletedPart], count: int) -> bool:
    """Whether ``parts`` are exactly parts 1..``count``, in order."""
    return [p.number for p in parts] == list(range(1, count + 1))
