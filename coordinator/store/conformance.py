"""The store check: try every promise the project relies on against one S3 endpoint.

``check_promises`` works under a throwaway folder of the given prefix (``store-check-<id>/``),
with the coordinator's own credentials, and deletes everything it wrote (aborting any upload it
left open) whatever happens. Each probe is one real request, presigned the way a node's grant is
(``S3Store.presign``) and sent with aiohttp as a node sends it:

- a correct PUT, then the same again (``If-None-Match: *``: a second write must be refused);
  where the store refuses the correct PUT, the same without ``If-None-Match``, then without the
  checksum header, to learn which header it refuses;
- the same URL with a body of another length, and of the same length but other bytes (the
  second once more with ``x-amz-sdk-checksum-algorithm`` signed, Ceph RGW's condition);
- a URL sent to another key, and one that expired;
- a multipart upload: a part of another length and of other bytes, a completion, and a second
  upload completed at the same key with ``If-None-Match: *``; a third whose first part is under
  5 MiB (a store should refuse to complete it; the project's parts never are);
- a ranged GET, a listing of the folder, and DeleteObjects of everything in it.

The result is a ``coordinator.store.promises.Report``: a row per promise for the operator, and
the ``StoreProfile`` the coordinator works with. About 25 requests of at most a few KiB: a
fraction of a second on a local store, a few seconds across the internet.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import os
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from coordinator.base.errors import UNAVAILABLE_CODES, StorageError
from coordinator.store.presign import Request, get_request, part_request, put_request
from coordinator.store.promises import ACCEPT_SETTING, Report, StoreProfile
from coordinator.store.storage import S3Store

#: Bytes of each probe object (and of each probe part).
PROBE_BYTES = 1024
#: Seconds a probe's URL is valid (the expired probe's: 1, sent after it lapsed).
PROBE_EXPIRY_S = 300
#: Seconds one probe request may take.
PROBE_TIMEOUT_S = 30.0
#: What the project does where a store lets other bytes through.
UNBOUND = f"refuses to start, unless {ACCEPT_SETTING}"
#: Answers that mean "not now" (501 is not among them: B2 refuses a header with it).
UNAVAILABLE_STATUS = frozenset({500, 502, 503, 504})
_CODE = re.compile(rb"<Code>([^<]{1,64})</Code>")


def _sha_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


@dataclass(frozen=True)
class Answer:
    """What the store answered one probe: the status, its error code, the body."""

    status: int
    code: str
    body: bytes
    headers: dict[str, str]  # names lower-cased

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def __str__(self) -> str:
        if self.ok:
            return f"accepted it ({self.status})"
        return f"refused it ({self.status} {self.code})".replace(" )", ")")


class Prober:
    """Sends presigned probes to ``store`` under ``folder`` and remembers what to clean up."""

    def __init__(self, store: S3Store, folder: str, session: aiohttp.ClientSession) -> None:
        self.store = store
        self.folder = folder
        self.session = session
        self.uploads: list[tuple[str, str]] = []

    def key(self, name: str) -> str:
        return f"{self.folder}{name}"

    async def send(
        self, method: str, url: str, headers: dict[str, str], body: bytes = b""
    ) -> Answer:
        """The store's answer; ``StorageError`` (unreachable) where it gave none or said it
        cannot serve now: an outage says nothing about a promise."""
        try:
            async with self.session.request(
                method, url, headers=headers, data=body if method == "PUT" else None
            ) as resp:
                data = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise StorageError(f"store check: {method} {url.split('?')[0]}: {exc!r}") from exc
        match = _CODE.search(data)
        code = match.group(1).decode(errors="replace") if match else ""
        if resp.status in UNAVAILABLE_STATUS or code in UNAVAILABLE_CODES:
            raise StorageError(
                f"store check: {method} {url.split('?')[0]}: {resp.status} {code}",
                code=code or str(resp.status),
            )
        headers = {name.lower(): value for name, value in resp.headers.items()}
        return Answer(resp.status, code, data, headers)

    async def put(
        self, request: Request, body: bytes, *, url: str | None = None, expires_s: int = 0
    ) -> Answer:
        """PUT ``body`` with ``request``'s headers (its Content-Length: the body's) to the URL
        signed for ``request`` (or ``url``)."""
        signed = url or self.store.presign(request, expires_s or PROBE_EXPIRY_S)
        headers = dict(request.headers or {})
        headers["Content-Length"] = str(len(body))
        return await self.send("PUT", signed, headers, body)

    async def boto(self, what: str, call: Callable[[], Any]) -> Any:
        return await self.store.run(what, call)


async def check_promises(store: S3Store, prefix: str) -> Report:
    """Try every promise under ``{prefix}store-check-<id>/``; the report, everything deleted."""
    folder = f"{prefix}store-check-{uuid.uuid4().hex[:12]}/"
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session:
        probe = Prober(store, folder, session)
        report = Report()
        try:
            await _run(probe, report)
        finally:
            await _clean(probe)
    return report


async def _run(probe: Prober, report: Report) -> None:
    store = probe.store
    data = os.urandom(PROBE_BYTES)
    other = bytes(b ^ 0xFF for b in data)
    sha = _sha_b64(data)
    profile = StoreProfile()
    bound = True
    # A URL that lapsed a minute ago; where boto3 signs (no signing in the past), one that
    # lapses in a second, sent last.
    expired_request = put_request(probe.key("expired"), len(data), sha, once=False)
    expired_url = store.presign_lapsed(expired_request)
    lapses_at = time.monotonic()
    if expired_url is None:
        expired_url, lapses_at = store.presign(expired_request, 1), lapses_at + 2.0

    # A correct upload, with every header a grant carries; where refused, without the
    # headers a store may not know, one at a time.
    put = put_request(probe.key("object"), len(data), sha)
    first = await probe.put(put, data)
    if first.ok:
        report.add("upload", True, str(first), "-")
    else:
        plain = put_request(probe.key("object"), len(data), sha, once=False)
        second = await probe.put(plain, data)
        bare = put_request(probe.key("object"), len(data), None, once=False)
        third = second if second.ok else await probe.put(bare, data)
        if second.ok:
            profile = replace(profile, put_header=False, put_once=False)
            report.add("upload", True, f"refused If-None-Match ({first.status} {first.code})",
                       "leaves the header out")  # fmt: skip
            put = plain
        elif third.ok:
            profile = replace(profile, put_header=False, put_once=False, checksum_header=False)
            report.add("upload", True, f"refused x-amz-checksum-sha256 ({second.status}"
                       f" {second.code})", UNBOUND)  # fmt: skip
            bound = False
            put = bare
        else:
            profile = replace(profile, works=False)
            report.add("upload", False, str(third), "cannot run: a correct upload fails")
            report.profile = profile
            return
    if profile.put_header:
        again = await probe.put(put, data)
        kept = again.status == 412
        profile = replace(profile, put_once=kept)
        report.add(
            "PUT If-None-Match: second write", kept, str(again),
            "-" if kept else "write-once by naming (keys carry the sha256)",
        )  # fmt: skip
    else:
        report.add("PUT If-None-Match: second write", False, "refuses the header",
                   "write-once by naming (keys carry the sha256)")  # fmt: skip

    once = profile.put_header
    # A signed length and a signed sha256 refuse other bodies.
    request = put_request(
        probe.key("length"), len(data), sha if profile.checksum_header else None, once=once
    )
    answer = await probe.put(request, data[:-1])
    bound &= _bound(report, "PUT signed length: other length", answer)
    checksum = sha if profile.checksum_header else None
    request = put_request(probe.key("checksum"), len(data), checksum, once=once)
    answer = await probe.put(request, other)
    if answer.ok and checksum is not None:
        sdk = put_request(probe.key("checksum-sdk"), len(data), sha, once=once, sdk=True)
        retry = await probe.put(sdk, other)
        if not retry.ok and (await probe.put(sdk, data)).ok:
            profile = replace(profile, sdk_checksum=True)
            report.add("PUT signed sha256: other bytes", True,
                       f"{answer}; with the algorithm signed, {retry}",
                       "also signs x-amz-sdk-checksum-algorithm")  # fmt: skip
        else:
            bound &= _bound(report, "PUT signed sha256: other bytes", answer)
    else:
        bound &= _bound(report, "PUT signed sha256: other bytes", answer)
    # The signature: another key, and a lapsed URL (at the end).
    request = put_request(probe.key("signed-key"), len(data), checksum, once=once)
    url = store.presign(request, PROBE_EXPIRY_S).replace("/signed-key?", "/other-key?", 1)
    bound &= _bound(report, "URL sent to another key", await probe.put(request, data, url=url))

    # Downloads: the object back, whole and a range of it.
    get_url = store.presign(get_request(probe.key("object")), PROBE_EXPIRY_S)
    whole = await probe.send("GET", get_url, {})
    if not (whole.ok and whole.body == data):
        profile = replace(profile, works=False)
        report.add("GET", False, str(whole), "cannot run: a download fails")
    ranged = await probe.send("GET", get_url, {"Range": "bytes=100-199"})
    range_kept = (
        ranged.status == 206
        and ranged.body == data[100:200]
        and ranged.headers.get("content-range") == f"bytes 100-199/{len(data)}"
    )
    profile = replace(profile, ranged=range_kept)
    report.add("GET with Range", range_kept, f"answered {ranged.status}",
               "-" if range_kept else "cannot run: resumed downloads need it")  # fmt: skip

    profile, parts_bound = await _multipart(probe, report, profile, data, other)
    bound &= parts_bound

    # Listing and deleting the folder.
    try:
        listed = await store.sizes(probe.folder)
    except StorageError as exc:
        if exc.unreachable:
            raise
        listed, listing = {}, f"refused it ({exc.code})"
    else:
        listing = f"listed {len(listed)} objects"
    kept = listed.get(probe.key("object")) == len(data)
    profile = replace(profile, listing=kept)
    report.add("ListObjectsV2 of a prefix", kept, listing,
               "-" if kept else "confirms each upload with a HEAD")  # fmt: skip

    await asyncio.sleep(max(0.0, lapses_at - time.monotonic()))
    answer = await probe.put(expired_request, data, url=expired_url)
    bound &= _bound(report, "expired URL", answer)

    keys = [probe.key(n) for n in ("object", "length", "checksum", "checksum-sdk")]
    keys += [probe.key(n) for n in ("signed-key", "other-key", "expired", "parts", "small")]
    try:
        await store.delete_keys(keys)
        left = await store.sizes(probe.folder) if profile.listing else {}
        deleted, did = not left, f"left {len(left)} objects" if left else "deleted them"
    except StorageError as exc:
        if exc.unreachable:
            raise
        deleted, did = False, f"refused it ({exc.code})"
    profile = replace(profile, multi_delete=deleted, bound=bound)
    report.add("DeleteObjects", deleted, did, "-" if deleted else "deletes one key at a time")
    report.profile = profile


def _bound(report: Report, promise: str, answer: Answer) -> bool:
    """A probe that sent what a grant does not allow: kept if the store refused it."""
    kept = not answer.ok
    report.add(promise, kept, str(answer), "-" if kept else UNBOUND)
    return kept


async def _multipart(
    probe: Prober, report: Report, profile: StoreProfile, data: bytes, other: bytes
) -> tuple[StoreProfile, bool]:
    """The multipart probes; the profile with what they found, and whether parts are bound."""
    store = probe.store
    client = store.client
    bucket = store.bucket
    key = probe.key("parts")
    sdk, sums = profile.sdk_checksum, profile.checksum_header

    async def create(at: str) -> str:
        resp = await probe.boto(
            f"create upload {at}",
            lambda: client.create_multipart_upload(
                Bucket=bucket, Key=at, **({"ChecksumAlgorithm": "SHA256"} if sums else {})
            ),
        )
        upload_id: str = resp["UploadId"]
        probe.uploads.append((at, upload_id))
        return upload_id

    async def part(at: str, upload_id: str, number: int, body: bytes, sent: bytes) -> Answer:
        checksum = _sha_b64(body) if sums else None
        request = part_request(at, upload_id, number, len(body), checksum, sdk=sdk)
        return await probe.put(request, sent)

    async def complete(at: str, upload_id: str, parts: list[tuple[str, bytes]], once: bool) -> str:
        listed = [
            {"PartNumber": n, "ETag": etag, **({"ChecksumSHA256": _sha_b64(body)} if sums else {})}
            for n, (etag, body) in enumerate(parts, 1)
        ]
        extra = {"IfNoneMatch": "*"} if once else {}
        try:
            await probe.boto(
                f"complete upload {at}",
                lambda: client.complete_multipart_upload(
                    Bucket=bucket, Key=at, UploadId=upload_id,
                    MultipartUpload={"Parts": listed}, **extra,
                ),
            )  # fmt: skip
        except StorageError as exc:
            if exc.unreachable:
                raise
            return exc.code or "failed"
        probe.uploads.remove((at, upload_id))
        return ""

    try:
        upload_id = await create(key)
    except StorageError as exc:
        if exc.unreachable:
            raise
        report.add("multipart upload", False, f"refused it ({exc.code})",
                   "sends every object as one PUT")  # fmt: skip
        return replace(profile, multipart=False), True
    bound = _bound(report, "part signed length: other length",
                   await part(key, upload_id, 1, data, data[:-1]))  # fmt: skip
    bound &= _bound(report, "part signed sha256: other bytes",
                    await part(key, upload_id, 1, data, other))  # fmt: skip
    answer = await part(key, upload_id, 1, data, data)
    if not answer.ok:
        report.add("multipart upload", False, f"a correct part: {answer}",
                   "sends every object as one PUT")  # fmt: skip
        return replace(profile, multipart=False), bound
    etag = answer.headers.get("etag", "")
    error = await complete(key, upload_id, [(etag, data)], True)
    header = True
    if error:
        header = False
        error = await complete(key, upload_id, [(etag, data)], False)
        if error:
            report.add("multipart upload", False, f"refused the completion ({error})",
                       "sends every object as one PUT")  # fmt: skip
            return replace(profile, multipart=False), bound
    # A second upload completed at the same key.
    if header:
        second = await create(key)
        answer = await part(key, second, 1, data, data)
        error = await complete(key, second, [(answer.headers.get("etag", ""), data)], True)
        kept = error in ("PreconditionFailed", "412")
        did = f"refused it ({error})" if error else "accepted it"
        report.add("Complete If-None-Match: second", kept, did,
                   "-" if kept else "HEAD before each completion, and naming")  # fmt: skip
    else:
        kept = False
        report.add("Complete If-None-Match: second", False, "refuses the header",
                   "HEAD before each completion, and naming")  # fmt: skip
    profile = replace(profile, complete_header=header, complete_once=kept)
    # A first part under 5 MiB.
    small = probe.key("small")
    upload_id = await create(small)
    done = []
    for number in (1, 2):
        answer = await part(small, upload_id, number, data, data)
        done.append((answer.headers.get("etag", ""), data))
    error = await complete(small, upload_id, done, header)
    report.add("part under 5 MiB (not the last)", bool(error),
               f"refused it ({error})" if error else "accepted it",
               "- (the project's parts are 8 MiB or more)")  # fmt: skip
    return profile, bound


async def _clean(probe: Prober) -> None:
    """Abort what the probes left open and delete the folder, whatever went wrong."""
    store = probe.store
    for key, upload_id in list(probe.uploads):
        with contextlib.suppress(StorageError):
            abort = functools.partial(
                store.client.abort_multipart_upload,
                Bucket=store.bucket,
                Key=key,
                UploadId=upload_id,
            )
            await probe.boto(f"abort upload {key}", abort)
    try:
        left = list(await store.sizes(probe.folder))
    except StorageError:
        return  # nothing to list with: the probes deleted their keys by name already
    try:
        await store.delete_keys(left)
    except StorageError:  # no DeleteObjects here: one key at a time
        for key in left:
            with contextlib.suppress(StorageError):
                delete = functools.partial(store.client.delete_object, Bucket=store.bucket, Key=key)
                await probe.boto(f"delete {key}", delete)
