"""Presigned S3 URLs (SigV4, query authentication) in a few microseconds instead of boto3's ~1 ms.

Every upload grant and every submission's HEAD needs one presigned URL, a thousand of each per
round at a thousand nodes; through boto3 each costs the event loop a request model, an endpoint
ruleset, an event chain and a signer, most of a millisecond. The signature itself is two SHA-256
digests and five HMACs, and four of those HMACs (the signing key) only change with the UTC day,
so ``SigV4Presigner`` keeps the key per day and builds the rest directly. It signs exactly what
boto3 signs for the coordinator's requests: a PUT, a GET, a HEAD, a multipart upload's part,
whose URL also carries ``uploadId`` and ``partNumber`` (a payload of 1 GB has 128 parts, each
its own URL), and a page of a listing (the bucket's URL with the listing's parameters). The
canonical request is AWS's "Signature Version 4, query string authentication": method, path,
sorted query, sorted lower-case headers with ``host``, ``UNSIGNED-PAYLOAD``; addressing is
path-style (``{endpoint}/{bucket}/{key}``).

``Request`` describes each kind once (``put_request``, ``get_request``, ``head_request``,
``part_request``, ``list_request``), for both signers: what boto3 is asked, what this signer
signs.

Whether this endpoint and botocore agree is not assumed: ``matches_botocore`` (called when the
``S3Store`` is built) asks boto3 for each kind of URL the coordinator hands out, signs the same
request at the same second here, and compares the two URLs character for character. The store
uses this signer only when all of them are identical, and boto3 otherwise (another addressing
style, a botocore that signs differently): a URL from here is never one boto3 would not give.
"""

from __future__ import annotations

import calendar
import hashlib
import hmac
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit

#: What every presigned URL signs as its body: the payload is not part of the signature.
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
ALGORITHM = "AWS4-HMAC-SHA256"
#: Ports a URL's ``Host`` is signed without (botocore leaves a default port out).
DEFAULT_PORTS = {"http": 80, "https": 443}


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def _encode(text: str, safe: str = "-_.~") -> str:
    """SigV4's URI encoding: everything but unreserved characters (and ``safe``) as %XX."""
    return quote(text, safe=safe)


@dataclass(frozen=True)
class BucketAccess:
    """Where a bucket is and the key that signs for it: what both of the store's signers need."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = "us-east-1"


class SigV4Presigner:
    """Presigns S3 requests for one bucket with one access key, path-style."""

    def __init__(self, access: BucketAccess, *, clock: Callable[[], float] = time.time) -> None:
        endpoint_url, bucket = access.endpoint_url, access.bucket
        parts = urlsplit(endpoint_url)
        host = parts.hostname or ""
        if parts.port is not None and parts.port != DEFAULT_PORTS.get(parts.scheme):
            host = f"{host}:{parts.port}"
        #: The signed ``Host`` header: botocore's (and the HTTP client's) form of the endpoint.
        self.host = host
        #: Everything before the key: scheme, authority as given, base path and bucket.
        self.base = f"{endpoint_url.rstrip('/')}/{_encode(bucket, safe='/~')}"
        self._path = f"{parts.path.rstrip('/')}/{_encode(bucket, safe='/~')}"
        self.access_key = access.access_key
        self._secret = f"AWS4{access.secret_key}".encode()
        self.region = access.region
        self.clock = clock
        #: (yyyymmdd, the signing key of that day)
        self._key: tuple[str, bytes] = ("", b"")

    def _signing_key(self, day: str) -> bytes:
        if self._key[0] != day:
            key = _hmac(self._secret, day)
            for part in (self.region, "s3", "aws4_request"):
                key = _hmac(key, part)
            self._key = (day, key)
        return self._key[1]

    def presign(
        self,
        method: str,
        key: str,
        expires_s: int,
        headers: Mapping[str, str] | None = None,
        *,
        now: float | None = None,
        query: Sequence[tuple[str, str]] = (),
    ) -> str:
        """A URL for ``method`` on ``key``, valid for ``expires_s`` seconds from ``now`` (the
        clock's time), that the store accepts only with exactly ``headers`` (lower-cased).
        ``query``: the operation's own parameters (an upload part's ``uploadId`` and
        ``partNumber``), in the order boto3 puts them in the URL, before the signature's."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.clock() if now is None else now))
        day = stamp[:8]
        scope = f"{day}/{self.region}/s3/aws4_request"
        signed = {"host": self.host}
        signed.update(
            {name.lower(): " ".join(value.split()) for name, value in (headers or {}).items()}
        )
        names = sorted(signed)
        signed_headers = ";".join(names)
        # The signature's own parameters, in sorted order as the canonical query needs them.
        auth = [
            ("X-Amz-Algorithm", ALGORITHM),
            ("X-Amz-Credential", _encode(f"{self.access_key}/{scope}")),
            ("X-Amz-Date", stamp),
            ("X-Amz-Expires", str(expires_s)),
            ("X-Amz-SignedHeaders", _encode(signed_headers)),
        ]
        own = [(_encode(name), _encode(value)) for name, value in query]
        signed_query = "&".join(f"{name}={value}" for name, value in sorted(auth + own))
        # An empty key addresses the bucket itself (a listing), without a trailing slash.
        tail = f"/{_encode(key, safe='/~')}" if key else ""
        path = f"{self._path}{tail}"
        canonical = "\n".join(
            (
                method,
                path,
                signed_query,
                "".join(f"{name}:{signed[name]}\n" for name in names),
                signed_headers,
                UNSIGNED_PAYLOAD,
            )
        )
        digest = hashlib.sha256(canonical.encode()).hexdigest()
        to_sign = f"{ALGORITHM}\n{stamp}\n{scope}\n{digest}"
        signature = hmac.new(self._signing_key(day), to_sign.encode(), hashlib.sha256).hexdigest()
        # boto3's order in the URL: the operation's parameters, then the signature's.
        url_query = "&".join(f"{name}={value}" for name, value in [*own, *auth])
        return f"{self.base}{tail}?{url_query}&X-Amz-Signature={signature}"


@dataclass(frozen=True)
class Request:
    """One kind of request the coordinator presigns, as both signers see it: boto3's
    ``operation`` and ``params`` (beside the bucket), and the method, the headers the URL binds
    and the operation's own query parameters for ``SigV4Presigner``."""

    operation: str
    params: dict[str, Any]
    method: str
    key: str
    headers: dict[str, str] | None = None
    query: tuple[tuple[str, str], ...] = ()


def checksum_headers(checksum: str | None, sdk: bool) -> dict[str, str]:
    """The headers that bind a body to its sha256 (base64): ``x-amz-checksum-sha256``, and with
    ``sdk`` also ``x-amz-sdk-checksum-algorithm`` (Ceph RGW checks the checksum only then).
    None: no checksum (a store that refuses the header: nothing binds the bytes)."""
    if checksum is None:
        return {}
    headers = {"x-amz-checksum-sha256": checksum}
    if sdk:
        headers["x-amz-sdk-checksum-algorithm"] = "SHA256"
    return headers


def put_request(
    key: str, size: int, checksum: str | None, *, once: bool = True, sdk: bool = False
) -> Request:
    """A PUT of ``size`` bytes with sha256 ``checksum`` (base64); write-once (``If-None-Match:
    *``) unless ``once`` is False (a store that refuses the header); ``sdk``: the checksum's
    algorithm signed as well (``checksum_headers``)."""
    headers = {"Content-Length": str(size), **checksum_headers(checksum, sdk)}
    params: dict[str, Any] = {"Key": key, "ContentLength": size}
    if checksum is not None:
        params["ChecksumSHA256"] = checksum
        if sdk:
            params["ChecksumAlgorithm"] = "SHA256"
    if once:
        headers["If-None-Match"] = "*"
        params["IfNoneMatch"] = "*"
    return Request("put_object", params, "PUT", key, headers)


def part_request(
    key: str, upload_id: str, number: int, size: int, checksum: str | None, *, sdk: bool = False
) -> Request:
    """Part ``number`` of multipart upload ``upload_id``: ``size`` bytes with sha256
    ``checksum`` (base64; None: unbound, ``checksum_headers``)."""
    headers = {"Content-Length": str(size), **checksum_headers(checksum, sdk)}
    params: dict[str, Any] = {"Key": key, "UploadId": upload_id, "PartNumber": number}
    params["ContentLength"] = size
    if checksum is not None:
        params["ChecksumSHA256"] = checksum
        if sdk:
            params["ChecksumAlgorithm"] = "SHA256"
    query = (("uploadId", upload_id), ("partNumber", str(number)))
    return Request("upload_part", params, "PUT", key, headers, query)


def get_request(key: str) -> Request:
    return Request("get_object", {"Key": key}, "GET", key)


def head_request(key: str) -> Request:
    """A HEAD that asks for the stored checksum."""
    headers = {"x-amz-checksum-mode": "ENABLED"}
    return Request("head_object", {"Key": key, "ChecksumMode": "ENABLED"}, "HEAD", key, headers)


def list_request(prefix: str, token: str | None = None, max_keys: int = 1000) -> Request:
    """A page of at most ``max_keys`` of the objects under ``prefix``, after the page that
    answered ``token``; keys come percent-encoded (``encoding-type=url``, as boto3 asks)."""
    params: dict[str, Any] = {"Prefix": prefix}
    query = [("list-type", "2"), ("prefix", prefix)]
    if token is not None:
        params["ContinuationToken"] = token
        query.append(("continuation-token", token))
    params["MaxKeys"] = max_keys
    query += [("max-keys", str(max_keys)), ("encoding-type", "url")]
    return Request("list_objects_v2", params, "GET", "", None, tuple(query))


def signed_at(url: str) -> float:
    """The time (epoch seconds) a presigned URL was signed at, from its ``X-Amz-Date``."""
    stamp = parse_qs(urlsplit(url).query)["X-Amz-Date"][0]
    return float(calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ")))


def matches_botocore(
    presigner: SigV4Presigner,
    botocore_url: str,
    method: str,
    key: str,
    expires_s: int,
    headers: Mapping[str, str] | None = None,
    query: Sequence[tuple[str, str]] = (),
) -> bool:
    """Whether ``presigner`` gives exactly ``botocore_url`` for the same request and second."""
    try:
        now = signed_at(botocore_url)
    except (KeyError, ValueError):
        return False
    signed = presigner.presign(method, key, expires_s, headers, now=now, query=query)
    return signed == botocore_url
