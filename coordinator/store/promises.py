"""What a store promises and what the coordinator does with each answer.

``coordinator.store.conformance`` finds out, by trying, which promises an S3-compatible store
keeps (``sparseloco store check``, and every coordinator start). The answer is a ``Report``: one
``Finding`` per promise, and the ``StoreProfile`` the coordinator then works with:

- the bytes bound to the URL (a signed length and a signed sha256 refuse other bodies, an altered
  or expired URL is refused): without it a grant holder could write anything at its key, so the
  coordinator refuses to start (``problems``) unless the operator accepts that risk
  (``storage.accept_unbound_uploads``, SECURITY.md); nodes still check every payload's size and
  sha256 against the signed manifest;
- write-once by ``If-None-Match: *`` on PutObject and on CompleteMultipartUpload: without it,
  write-once by naming (``digest_keys``: a payload's key carries its sha256, so a second upload
  with other bytes goes to another key, never to the one a manifest names); the header is not
  sent at all where the store refuses requests that carry it (Backblaze B2 answers 501);
- Ceph RGW checks a signed checksum only when ``x-amz-sdk-checksum-algorithm`` is signed too
  (``sdk_checksum``);
- a ranged GET (resumed downloads, nodes of several processes): without it the coordinator
  refuses to start;
- a listing of a prefix (one per round to confirm uploads; without it a HEAD per submission)
  and DeleteObjects (retention; without it one DELETE per key).

Pure data: nothing here talks to a store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The setting that starts a coordinator on a store that does not bind bytes to a URL.
ACCEPT_SETTING = "storage.accept_unbound_uploads"


@dataclass(frozen=True)
class StoreProfile:
    """How the coordinator uses a store, from what the store was seen to do."""

    #: A correct presigned PUT and GET work at all.
    works: bool = True
    #: The store accepts requests that carry ``x-amz-checksum-sha256`` (False: Backblaze B2).
    checksum_header: bool = True
    #: A signed length, a signed sha256 and the signature itself (key, expiry) are enforced.
    bound: bool = True
    #: ``If-None-Match: *`` on PutObject refuses a second write.
    put_once: bool = True
    #: The store accepts PUTs that carry ``If-None-Match`` (False: leave the header out).
    put_header: bool = True
    #: ``If-None-Match: *`` on CompleteMultipartUpload refuses when the key holds an object.
    complete_once: bool = True
    #: The store accepts completions that carry ``If-None-Match``.
    complete_header: bool = True
    #: Sign ``x-amz-sdk-checksum-algorithm: SHA256`` beside the checksum (Ceph RGW).
    sdk_checksum: bool = False
    #: Multipart uploads work (create, presigned parts, completion); False: one PUT per object.
    multipart: bool = True
    #: A presigned GET with ``Range`` answers 206 with those bytes.
    ranged: bool = True
    #: ListObjectsV2 lists a prefix.
    listing: bool = True
    #: DeleteObjects deletes several keys in one request.
    multi_delete: bool = True

    @property
    def digest_keys(self) -> bool:
        """Write-once by naming: payload keys carry the payload's sha256."""
        return not (self.put_once and self.complete_once)

    def problems(self, *, accept_unbound: bool = False) -> list[str]:
        """Why the coordinator cannot run on this store (empty: it can), each with the fix."""
        found = []
        if not self.works:
            found.append(
                "a correct presigned upload or download failed: check the endpoint URL and"
                " that the store supports SigV4 presigned URLs (path-style addressing)"
            )
        if not self.bound and not accept_unbound:
            found.append(
                "the store does not bind an upload's bytes to its presigned URL (a signed length"
                " or sha256, or the signature itself, is not enforced), so a node could write"
                " other bytes than it announced; use a store that enforces them (docs/stores.md),"
                f" or accept the risk with {ACCEPT_SETTING} = true (SECURITY.md)"
            )
        if not self.ranged:
            found.append(
                "the store does not answer a ranged GET with 206 and those bytes: resumed"
                " downloads and nodes of several processes need it; use another store"
                " (docs/stores.md)"
            )
        return found

    def fallbacks(self, *, accept_unbound: bool = False) -> list[str]:
        """One line per promise the store does not keep that the coordinator works around."""
        lines = []
        if self.digest_keys:
            lines.append(
                "write-once by naming: the store does not refuse a second write with"
                " If-None-Match, so each payload's key carries its sha256"
            )
        if not (self.put_header and self.complete_header):
            lines.append("If-None-Match is left out of the requests the store refuses with it")
        if self.sdk_checksum:
            lines.append("uploads also sign x-amz-sdk-checksum-algorithm: SHA256")
        if not self.multipart:
            lines.append("every object goes as one PUT: the store's multipart uploads failed")
        if not self.listing:
            lines.append("uploads are confirmed with a HEAD each: the store lists no prefix")
        if not self.multi_delete:
            lines.append("retention deletes one key at a time: the store has no DeleteObjects")
        if not self.bound and accept_unbound:
            lines.append(
                f"RISK ACCEPTED ({ACCEPT_SETTING}): the store does not bind bytes to a URL;"
                " nodes check every payload's sha256 against the signed manifest"
            )
        return lines


@dataclass(frozen=True)
class Finding:
    """One promise tried: kept (True), not kept (False) or not tried (None: an earlier step
    failed), what the store did, and what the project does about it."""

    promise: str
    kept: bool | None
    did: str
    project: str


@dataclass
class Report:
    """Every promise tried on one store, and the profile the coordinator takes from them."""

    findings: list[Finding] = field(default_factory=list)
    profile: StoreProfile = StoreProfile()

    def add(self, promise: str, kept: bool | None, did: str, project: str) -> None:
        self.findings.append(Finding(promise, kept, did, project))

    def table(self) -> str:
        """The findings as a plain text table: promise, kept, what the store did, the project."""
        rows = [("promise", "kept", "the store", "the project")]
        for f in self.findings:
            kept = "-" if f.kept is None else ("yes" if f.kept else "NO")
            rows.append((f.promise, kept, f.did, f.project))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = []
        for r in rows:
            cells = [r[i].ljust(widths[i]) for i in range(3)]
            lines.append("  ".join([*cells, r[3]]).rstrip())
        lines.insert(1, "  ".join("-" * w for w in [*widths, len(rows[0][3])]))
        return "\n".join(lines)
