"""Who may submit to which round, what a retry is answered, and the verdict on a submission.

A node submits a payload it uploaded for the round in progress, once (payloads are write-once).
The rules, applied inside the round machine's transactions:

- a round after the current one (or past the run's end) is unknown (404);
- a round that is not open any more, or not yet, refuses with ``round_closed`` (and the node is
  noted as late, ``RoundProgress.note_late``); one the node is not expected in, ``not_expected``;
- the same submission again (size, sha256, base) is a retry and gets the first answer, even after
  the round closed; a different one is ``already_submitted``;
- a new submission is accepted unless the stored object does not match its size and sha256
  (``bad_digest``: looked at before the answer, or, for a payload whose upload this process
  granted, before the round closes, ``coordinator.rules.payloadchecks``) or, once the reports
  of the round it builds on settle the base fingerprint (``coordinator.rules.votes``), it was
  built on another (``wrong_base``).
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.base.errors import Conflict, UnknownRound
from coordinator.rules.membership import Membership
from coordinator.rules.progress import RoundProgress
from coordinator.rules.votes import Votes
from coordinator.state.db import Database, RoundRow, SubmissionRow
from protocol.messages import Exclusion, RoundState, SubmitRequest, SubmitResponse
from protocol.runconfig import RunConfig


@dataclass(frozen=True)
class SubmissionRules:
    """The submission rules of one run, over the database and the machine's in-memory views."""

    db: Database
    run: RunConfig
    members: Membership
    progress: RoundProgress
    votes: Votes

    def check(self, cur: RoundRow, node_id: str, round_: int) -> None:
        """Raise unless ``node_id`` may upload to / submit for ``round_`` now (``cur``: the
        newest round)."""
        if round_ > cur.round or (cur.state == RoundState.CLOSED and round_ >= self.run.rounds):
            raise UnknownRound(round_)
        if round_ < cur.round or cur.state != RoundState.OPEN:
            self.progress.note_late(round_, node_id)
            raise Conflict("round_closed", f"round {round_} is not open for submissions")
        if not self.members.is_expected(node_id, round_):
            raise Conflict("not_expected", f"{node_id} is not expected in round {round_}")

    def previous(
        self, cur: RoundRow, node_id: str, round_: int, req: SubmitRequest
    ) -> SubmitResponse | None:
        """The answer already given to this submission (a retry), or ``None`` if it is new; a
        different submission raises (``round_closed`` first, else ``already_submitted``)."""
        prior = self.db.submission(round_, node_id)
        if prior is None:
            return None
        same = (prior.size, prior.sha256, prior.base_fingerprint) == (
            req.size,
            req.sha256,
            req.base_fingerprint,
        )
        if not same:
            self.check(cur, node_id, round_)  # a closed round says so first
            raise Conflict(
                "already_submitted", f"{node_id} already submitted a different payload to {round_}"
            )
        return _response(prior)

    def expected_base(self, round_: int) -> str | None:
        """The base fingerprint round ``round_`` must use, if the reports already settle it."""
        voted = self.run.base_round(round_)
        return None if voted is None else self.votes.majority(voted)

    def verdict(self, round_: int, req: SubmitRequest, digest_ok: bool | None) -> Exclusion | None:
        """Why a new submission is rejected, or ``None`` when it is accepted (``digest_ok``: the
        stored object matches its size and sha256; ``None``: it is confirmed later)."""
        base = self.expected_base(round_)
        if digest_ok is False:
            return Exclusion.BAD_DIGEST
        if base is not None and req.base_fingerprint != base:
            return Exclusion.WRONG_BASE
        return None


def _response(row: SubmissionRow) -> SubmitResponse:
    if row.rejected is None:
        return SubmitResponse(accepted=True)
    return SubmitResponse(accepted=False, reason=row.rejected.value)
