"""Upload grants: where a node may write, how, and the completion of an upload in parts.

A node holds no storage credentials. For each object it writes (its payload of a round, a
checkpoint, a probe) the coordinator hands it a grant for that key only:

- a presigned PUT bound to the size, the sha256 and ``If-None-Match: *`` (``grant``), the
  only kind before multipart uploads existed and still the kind for every object whose request
  names no parts;
- for a request with a ``PartPlan`` (``protocol.parts``), when the store can do it, a multipart
  upload created at the key and one presigned part URL per part (``coordinator.store.multipart``),
  completed by ``upload_complete`` once the node has uploaded every part. A store that refuses
  to create one (a credential without the permission) gets a single PUT instead, and a
  warning; one that does not answer, a 503 the node waits out.

Both handlers check the round state first: a node may write its own payload key of an open
round it is expected in, nothing else; only the holder of a checkpoint's grant completes its
upload (``checkpoint_complete``).
"""

from __future__ import annotations

import logging

from aiohttp import web

from coordinator.api.handling import ok, round_request
from coordinator.api.service import Coordinator
from coordinator.base.errors import ApiError, Conflict, StorageError
from protocol.messages import UploadGrant, UploadRequest
from protocol.parts import MultipartGrant, PartPlan, UploadComplete, UploadDone, parts_in_order

log = logging.getLogger("sparseloco.coordinator.app")


async def grant(
    coord: Coordinator, key: str, size: int, sha256: str, plan: PartPlan | None = None
) -> UploadGrant:
    """A write-once upload of ``size`` bytes hashing to ``sha256`` at ``key``: in parts when
    ``plan`` asks for it and the store can, else one presigned PUT."""
    expires = float(coord.config.server.presign_expiry_s)
    if plan is not None and coord.parts is not None:
        if not plan.fits(size):
            raise ApiError(
                422, "bad_parts", f"{len(plan.sha256)} parts of {plan.part_size} bytes do not"
                f" cut {size} bytes", "parts",
            )  # fmt: skip
        try:
            upload_id = await coord.parts.create(key)
        except StorageError as exc:
            if exc.unreachable:
                raise  # an outage: 503, and the node asks again
            # A refusal (no permission, no multipart on this store) would refuse every try:
            # the object goes as one PUT, as it would without parts.
            log.warning(
                "event=multipart_refused key=%s cause=%r fallback=single_put", key, exc.code
            )
        else:
            urls = await coord.parts.presign_parts(key, upload_id, size, plan)
            grant = MultipartGrant(upload_id=upload_id, part_size=plan.part_size, parts=urls)
            return UploadGrant(key=key, url="", headers={}, expires_in_s=expires, multipart=grant)
    url, headers = coord.store.presign_put(key, size, sha256)
    return UploadGrant(key=key, url=url, headers=headers, expires_in_s=expires)


def check_size(coord: Coordinator, size: int) -> None:
    limit = coord.config.storage.max_payload_bytes
    if size > limit:
        raise ApiError(413, "too_large", f"size {size} exceeds the run's limit {limit}", "size")


def own_payload_key(coord: Coordinator, node_id: str, round_: int, sha256: str) -> str:
    """The key of ``node_id``'s payload for ``round_`` hashing to ``sha256``, once the round
    state allows it."""
    coord.machine.check_submittable(node_id, round_)
    return coord.machine.payload_key(round_, node_id, sha256)


async def upload(request: web.Request) -> web.Response:
    coord, node_id, round_, req = await round_request(request, UploadRequest)
    check_size(coord, req.size)
    key = own_payload_key(coord, node_id, round_, req.sha256)
    granted = await grant(coord, key, req.size, req.sha256, req.parts)
    coord.machine.checks.grant(round_, node_id, req.sha256, req.size)
    parts = 0 if granted.multipart is None else len(granted.multipart.parts)
    if granted.multipart is not None:
        coord.part_keys.remember(round_, node_id, granted.multipart.upload_id, key)
    # DEBUG: one line per node and round (the round's close line sums them up).
    log.debug(
        "event=upload_granted round=%d node=%s size=%d parts=%d", round_, node_id, req.size, parts
    )
    return ok(granted)


async def checkpoint_complete(request: web.Request) -> web.Response:
    """Complete the grant holder's multipart upload of a checkpoint, write-once; the commit
    then verifies the file as it does any checkpoint."""
    coord, node_id, round_, req = await round_request(request, UploadComplete)
    coord.checkpoints.check_holder(node_id, round_)
    created = await _complete(coord, coord.checkpoints.key(round_), req)
    log.info(
        "event=checkpoint_upload_completed round=%d node=%s parts=%d created=%s",
        round_, node_id, len(req.parts), created,
    )  # fmt: skip
    return ok(UploadDone(created=created))


async def _complete(coord: Coordinator, key: str, req: UploadComplete) -> bool:
    if coord.parts is None:
        raise Conflict("no_multipart", "this coordinator grants single PUTs only")
    if not parts_in_order(req.parts, len(req.parts)):
        raise ApiError(422, "bad_parts", "parts must be numbered 1..n in order", "parts")
    return await coord.parts.complete(key, req.upload_id, req.parts)


async def upload_complete(request: web.Request) -> web.Response:
    """Complete the caller's multipart upload of its payload, write-once."""
    coord, node_id, round_, req = await round_request(request, UploadComplete)
    coord.machine.check_submittable(node_id, round_)
    key = coord.part_keys.key(round_, node_id, req.upload_id)
    if key is None and not coord.machine.digest_keys:  # granted before a restart: one key
        key = coord.machine.payload_key(round_, node_id, None)
    if key is None:  # keys named by digest, granted by an earlier process (or never)
        raise Conflict(
            "upload_incomplete", "this coordinator did not grant that upload; upload again"
        )
    created = await _complete(coord, key, req)
    log.info(
        "event=upload_completed round=%d node=%s parts=%d created=%s",
        round_, node_id, len(req.parts), created,
    )  # fmt: skip
    return ok(UploadDone(created=created))
