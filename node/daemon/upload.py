"""Getting a trained round's payload into the store and announced to the coordinator.

``submit`` asks for a presigned PUT (bound to this node's key, the size and the sha256,
write-once), uploads, and submits the digest with the fingerprint of the θ it trained from.
While the store does not take the payload, it tries again with a new grant each time for as
long as the round stays open; once the round closed without it, step 9 keeps the contribution
(``node.daemon.rounds``). A refusal that means "this round went on without you" is not an
error either.

A payload of ``multipart.MULTIPART_THRESHOLD`` bytes or more asks for an upload in parts
(``node.daemon.multipart``): every part is retried alone, and the coordinator completes the
upload once they are all in. When a part gives up (its retries spent while the store is
away), the parts the store took are kept and the next try sends only the others, with the same
grant while its URLs have half their life left; a store that refuses (an expired URL, an upload
aborted as stale, one it will not complete) means a new grant, and every part again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from node.daemon import multipart
from node.daemon.host import Daemon
from node.daemon.pending import PendingRound
from node.daemon.retry import Backoff
from node.errors import CoordinatorError, RetriesExhausted, TransferError
from protocol.causes import cause
from protocol.messages import RoundState, SubmitRequest, UploadGrant
from protocol.parts import CompletedPart, UploadComplete

log = logging.getLogger("sparseloco.node")

#: Share of a grant's life within which an upload in parts that failed goes on with it (only
#: the parts not yet taken are sent); after that, a new grant and every part again.
REUSE_SHARE = 0.5
#: Refusals that mean "this round went on without us"; the contribution stays in e.
MISSED = frozenset({"round_closed", "not_expected", "already_submitted", "run_finished"})


def _reusable(grant: UploadGrant, age_s: float) -> bool:
    """Whether an upload in parts that failed part way may go on with the same grant: its URLs
    have most of their life left (a single PUT always asks again)."""
    return grant.multipart is not None and age_s < REUSE_SHARE * grant.expires_in_s


async def _upload(
    d: Daemon, round_: int, grant: UploadGrant, payload: bytes, done: dict[int, CompletedPart]
) -> None:
    """The payload through ``grant``: one PUT, or every part not ``done`` and then the
    completion."""
    if grant.multipart is None:
        await d.transfers.put(grant.url, grant.headers, payload)
        return
    parts = await d.transfers.put_parts(grant.multipart, payload, done)
    request = UploadComplete(upload_id=grant.multipart.upload_id, parts=parts)
    try:
        await d.api.upload_complete(round_, request)
    except CoordinatorError as exc:
        if exc.error != "upload_incomplete":
            raise
        # The store would not complete it (a part lost, aborted as stale): upload it again.
        raise TransferError(f"upload: {exc}", exc.status) from exc


async def submit(d: Daemon, pending: PendingRound) -> None:
    """Upload through a presigned PUT and announce it; a missed round is not an error.

    While the store does not take the payload, the upload is tried again (a new grant each
    time) for as long as the round stays open; once it closed, step 9 keeps the
    contribution.
    """
    r, payload = pending.round, pending.payload
    t0 = time.perf_counter()
    pending.bytes_up = 0
    backoff = Backoff()
    try:
        plan = None  # one PUT
        if len(payload) >= multipart.MULTIPART_THRESHOLD:
            plan = await asyncio.to_thread(multipart.part_plan, payload)
        grant: UploadGrant | None = None
        granted_at = 0.0
        done: dict[int, CompletedPart] = {}  # the parts of this grant the store took
        while True:
            if grant is None or not _reusable(grant, d.clock.now() - granted_at):
                grant = await d.api.upload_grant(r, len(payload), pending.sha256, plan)
                granted_at, done = d.clock.now(), {}
            d.faults.crash_point(r, "mid_upload")
            started, failures, whole = d.clock.now(), d.link_failures, not done
            try:
                await _upload(d, r, grant, payload, done)
                if d.link_failures == failures and whole:
                    # Only a clean attempt of the whole payload measures the link: one that
                    # waited out an outage, or sent only the parts left, says nothing of it.
                    d.uploaded(len(payload), d.clock.now() - started)
                break
            except (TransferError, RetriesExhausted) as exc:
                if isinstance(exc, TransferError):
                    grant = None  # refused (an expired URL, an aborted upload): start over
                view = await d.api.round()
                still_open = view.round == r and view.state == RoundState.OPEN
                if not still_open or d.stopping.is_set():
                    # The round goes on without this payload; step 9 keeps it.
                    d.log("upload_failed", cause=repr(cause(exc)))
                    return
                log.debug("event=upload_retry node=%s round=%d error=%r", d.node_id, r, exc)
                await d.sleep(backoff.next())
        pending.bytes_up = len(payload)
        pending.timings["upload"] = time.perf_counter() - t0
        d.faults.crash_point(r, "after_upload")
        request = SubmitRequest(
            size=len(payload),
            sha256=pending.sha256,
            base_fingerprint=pending.base,
            steps=pending.steps,
            tokens=pending.tokens,
        )
        response = await d.api.submit(r, request)
        if not response.accepted:
            d.log("submission_rejected", reason=repr(response.reason))
        d.faults.crash_point(r, "after_submit")
    except CoordinatorError as exc:
        if exc.error not in MISSED:
            raise
        d.log("missed_round", reason=exc.error)
    finally:
        pending.submitted_at = d.clock.now()
