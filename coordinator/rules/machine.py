"""The round state machine: joins and leaves as rounds see them, submissions, opening, closing.

This is the coordinator's core, synchronous and free of HTTP: every method reads the database,
applies the rules of ``coordinator.rules.rounds`` and commits one transaction. The clock is
injected, so tests drive time by hand. Methods that may close rounds return the newly closed
rounds' signed manifests; the caller wakes waiters, counts metrics and hands them to the publisher.

Round life: ``waiting`` (fewer active members than ``min_nodes``) -> ``open`` (with a deadline)
-> ``closed`` (manifest signed, stored); closing the run's last round finishes the run, and every
active member with it (``finished``, never ``timed out``). Rounds are numbered from 0 everywhere.

The machine decides when; a helper per concern, each in ``coordinator.rules``, holds the rest:
who is a member and who fell silent (``membership``), what a submission may be
(``submissions``), what a close does (``closing``), who votes on θ after a round (``votes``:
only its participants), when a deadline closes a round (``deadlines``: held while nothing came,
paused while the store is down), and whether everyone waited for is in (``progress``: O(N) per
round, not O(N²)). A round waits for its expected members less those silent for
``timing.silent_rounds`` rounds in a row (``rounds.waited_set``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from coordinator.base.errors import UnknownRound
from coordinator.rules import rounds
from coordinator.rules.closing import RoundCloser
from coordinator.rules.deadlines import Deadlines
from coordinator.rules.membership import Membership
from coordinator.rules.payloadchecks import PayloadChecks
from coordinator.rules.progress import RoundProgress
from coordinator.rules.submissions import SubmissionRules
from coordinator.rules.votes import Votes
from coordinator.state.db import Database, RoundRow
from coordinator.state.signing import ManifestSigner
from protocol.keys import payload_key
from protocol.messages import (
    Exclusion,
    NodeCondition,
    RoundState,
    RoundView,
    SignedManifest,
    SubmitRequest,
    SubmitResponse,
)
from protocol.reports import RoundReport
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.coordinator.machine")


class RoundMachine:
    """The rounds of one run over one ``Database``; one instance per coordinator process."""

    def __init__(
        self,
        db: Database,
        run: RunConfig,
        signer: ManifestSigner,
        *,
        prefix: str = "",
        clock: Callable[[], float] = time.time,
        digest_keys: bool = False,
    ) -> None:
        self.db = db
        self.run = run
        self.run_id = run.run_id
        self.signer = signer
        self.prefix = prefix
        #: Write-once by naming: payload keys carry the payload's sha256 (``payload_key``).
        self.digest_keys = digest_keys
        self.clock = clock
        self.votes = Votes(db)
        self._open_run()
        #: The members; every active one counts as heard from just now (a fresh window).
        self.members = Membership(
            db, heartbeat_timeout_s=run.timing.heartbeat_timeout_s, now=clock()
        )
        self.progress = RoundProgress(
            db, self.waited, lambda: self.members.version, self.members.is_expected, run.timing
        )
        self.deadlines = Deadlines(db, self.members, run.timing)
        self.submissions = SubmissionRules(db, run, self.members, self.progress, self.votes)
        self.closer = RoundCloser(
            db, run, signer, self.members, self.votes, prefix=prefix, digest_keys=digest_keys
        )
        #: Submissions answered before their object was confirmed (``payloadchecks``).
        self.checks = PayloadChecks()
        cur = self._current()
        if cur.state == RoundState.OPEN:
            # Which of them a previous process confirmed is not kept: all are confirmed again.
            for row in db.submissions(cur.round):
                if row.rejected is None:
                    self.checks.defer(cur.round, row.node_id, row.size)
        if cur.state == RoundState.CLOSED:
            # A database written before members finished with the run may still list them as
            # active; they would otherwise "time out" of a run that is over.
            self.members.finish(cur.round)
        log.info("event=state_loaded run=%s round=%d state=%s", self.run_id, cur.round, cur.state)

    def _open_run(self) -> None:
        """Create the run in an empty database; refuse a database of another run."""
        if self.db.claim_run(self.run_id, self.run.canonical().decode()):
            log.info("event=run_created run=%s", self.run_id)

    # ---- queries -------------------------------------------------------------------------
    def _current(self) -> RoundRow:
        cur = self.db.current_round()
        if cur is None:
            raise RuntimeError("the database has no round; it was not initialised")
        return cur

    def finished(self) -> bool:
        return self._current().state == RoundState.CLOSED

    def round_number(self) -> int:
        """The round in progress (the run's length once it is finished)."""
        cur = self._current()
        return rounds.in_progress(cur.round, cur.state, self.run.rounds)[0]

    def round_view_state(self) -> RoundState:
        """The state of the round in progress (``finished`` once the run is over)."""
        cur = self._current()
        return rounds.in_progress(cur.round, cur.state, self.run.rounds)[1]

    def round_view(self, node_id: str) -> RoundView:
        """The current round as ``node_id`` sees it."""
        cur = self._current()
        number, state = rounds.in_progress(cur.round, cur.state, self.run.rounds)
        if state == RoundState.FINISHED:
            return RoundView(
                run_id=self.run_id,
                round=number,
                state=state,
                expected=False,
                last_closed=cur.round,
            )
        expected = cur.state == RoundState.OPEN and self.members.is_expected(node_id, cur.round)
        deadline_in_s = budget_in_s = None
        now = self.clock()
        if cur.state == RoundState.OPEN and cur.deadline is not None:
            deadline_in_s = max(0.0, cur.deadline - now)
        if cur.state == RoundState.OPEN and cur.budget is not None and cur.started_at is not None:
            budget_in_s = max(0.0, cur.started_at + cur.budget - now)
        return RoundView(
            run_id=self.run_id,
            round=cur.round,
            state=cur.state,
            expected=expected,
            submitted=node_id in self.progress.submitted(cur.round),
            deadline_in_s=deadline_in_s,
            last_closed=cur.round - 1,
            budget_s=cur.budget if cur.state == RoundState.OPEN else None,
            budget_in_s=budget_in_s,
        )

    # ---- membership ----------------------------------------------------------------------
    def join(
        self,
        node_id: str,
        client: str = "",
        instance: str | None = None,
        previous: str | None = None,
    ) -> int:
        """Make ``node_id`` an active member (it may open a waiting round); returns its slot.

        ``instance`` binds the member to the joining process; ``previous`` is the process it
        succeeds on the same state directory (``Membership.check_instance``).
        """
        now = self.clock()
        with self.db.tx():
            cur = self._current()
            finished = cur.state == RoundState.CLOSED
            if finished:
                joined = self.run.rounds
            else:
                has_subs = bool(self.progress.submitted(cur.round))
                joined = rounds.joined_round_for(cur.state, cur.round, has_subs)
            slot = self.members.join(
                node_id,
                client,
                joined=joined,
                current=cur.round,
                now=now,
                instance=instance,
                previous=previous,
                finished=finished,
            )
            self._maybe_open(now)
        return slot

    def check_instance(self, node_id: str, instance: str | None) -> None:
        """Refuse a call from a process other than the one ``node_id``'s membership is bound to."""
        self.members.check_instance(node_id, instance, self.clock())

    def heard(self, node_id: str, condition: NodeCondition) -> bool:
        """A request of ``node_id`` carried its condition: a heartbeat of an active member
        (True), nothing otherwise (``Members.heard``)."""
        return self.members.heard(node_id, self.clock(), condition)

    def revoke(self, node_ids: set[str]) -> list[SignedManifest]:
        """Their tokens were revoked: they take no part any more; an open round stops waiting."""
        current = self._current().round
        changed = [n for n in sorted(node_ids) if self.members.revoke(n, current)]
        return self._maybe_close(self.clock()) if changed else []

    def heartbeat(self, node_id: str, condition: NodeCondition | None = None) -> RoundView:
        """``node_id`` is alive, doing ``condition`` (``None``: it did not say)."""
        self.members.heartbeat(node_id, self.clock(), condition)
        return self.round_view(node_id)

    def store_down(self) -> int | None:
        """The coordinator cannot reach the store: deadlines pause (``Deadlines.pause``); the
        open round, if any."""
        self.deadlines.pause(self.clock())
        cur = self._current()
        return cur.round if cur.state == RoundState.OPEN else None

    def store_back(self) -> tuple[int, float] | None:
        """The store answers again: the open round's deadline moves later by the time the
        outage took from it; (round, seconds), or ``None`` without an open round."""
        return self.deadlines.resume(self._current(), self.clock())

    def leave(self, node_id: str) -> list[SignedManifest]:
        """Mark ``node_id`` as left; an open round no longer waits for it."""
        self.members.leave(node_id, self._current().round)
        return self._maybe_close(self.clock())

    def tick(self) -> list[SignedManifest]:
        """Time out silent members, open a waiting round, close an overdue one."""
        now = self.clock()
        self.members.time_out(self._current().round, now)
        with self.db.tx():
            self._maybe_open(now)
        return self._maybe_close(now)

    # ---- submissions (the rules: coordinator.rules.submissions) ---------------------------
    def payload_key(self, round_: int, node_id: str, sha256: str | None) -> str:
        """The key of ``node_id``'s payload of ``round_`` that hashes to ``sha256`` (hex; only
        needed, and then required, with ``digest_keys``)."""
        if not self.digest_keys:
            return payload_key(self.prefix, self.run_id, round_, node_id)
        if sha256 is None:
            raise ValueError("with keys named by digest, a payload's key needs its sha256")
        return payload_key(self.prefix, self.run_id, round_, node_id, sha256)

    def check_submittable(self, node_id: str, round_: int) -> None:
        """Raise unless ``node_id`` may upload to / submit for ``round_`` now."""
        self.submissions.check(self._current(), node_id, round_)

    def previous_submission(
        self, node_id: str, round_: int, req: SubmitRequest
    ) -> SubmitResponse | None:
        """The answer already given to this submission (a retry, answered even after the round
        closed), or ``None`` if it is new; a different one is refused."""
        cur = self._current()
        if round_ == cur.round and node_id not in self.progress.submitted(round_):
            return None  # the current round's submitters are in memory: a first needs no read
        return self.submissions.previous(cur, node_id, round_, req)

    def expected_base(self, round_: int) -> str | None:
        """The base fingerprint round ``round_`` must use, if the reports already settle it."""
        return self.submissions.expected_base(round_)

    def submit(
        self, node_id: str, round_: int, req: SubmitRequest, digest_ok: bool | None
    ) -> tuple[SubmitResponse, list[SignedManifest]]:
        """Record a submission (``digest_ok``: the stored object matches size and sha256;
        ``None``: not checked yet, it is confirmed before the round closes, ``confirm``)."""
        with self.db.tx():
            prior = self.previous_submission(node_id, round_, req)
            if prior is not None:
                return prior, []
            self.check_submittable(node_id, round_)
            rejected = self.submissions.verdict(round_, req, digest_ok)
            seq = self.db.add_submission(
                round_, node_id, req.size, req.sha256, req.base_fingerprint, rejected,
                self.clock(), req.steps, req.tokens,
            )  # fmt: skip
        self.progress.add(round_, node_id)
        if rejected is None and digest_ok is None:
            self.checks.defer(round_, node_id, req.size)
        if rejected is None:
            self.deadlines.arrived(self._current(), self.clock())
        # An accepted submission is a line per node and round (DEBUG); a rejection stands out.
        log.log(
            logging.DEBUG if rejected is None else logging.INFO,
            "event=submitted round=%d node=%s seq=%d rejected=%s",
            round_,
            node_id,
            seq,
            "-" if rejected is None else rejected.name,
        )
        accepted = rejected is None
        reason = None if rejected is None else rejected.value
        return SubmitResponse(accepted=accepted, reason=reason), self._maybe_close(self.clock())

    # ---- opening and closing (what a close does: coordinator.rules.closing) ---------------
    def _maybe_open(self, now: float) -> None:
        self.closer.open_if_ready(self._current(), now)

    def _maybe_close(self, now: float) -> list[SignedManifest]:
        closed: list[SignedManifest] = []
        for _ in range(2):  # a new round is never closable at once: the bound guards a bug
            cur = self._current()
            if cur.state != RoundState.OPEN or cur.deadline is None:
                break
            if not self.deadlines.overdue(cur, now) and not self.progress.may_close(cur, now):
                break  # early only when everyone waited for is in (coordinator.rules.progress)
            if self.checks.pending(cur.round):
                self.checks.wanted = True  # closes once they are confirmed (``confirm``)
                break
            closed.append(self.close(cur.round, now))
        return closed

    def confirm_wanted(self) -> tuple[int, dict[str, int]] | None:
        """(round, node id -> size) of the unconfirmed submissions a close waits for, if any."""
        checks = self.checks
        return (checks.round, checks.pending(checks.round)) if checks.wanted else None

    def confirm(self, round_: int, checked: set[str], bad: set[str]) -> list[SignedManifest]:
        """The objects of ``checked`` submissions to ``round_`` were looked at; those of
        ``bad`` are missing or not what was submitted: rejected as a bad digest, as a HEAD
        at the submit would have. Then the round closes if it is due."""
        if bad:
            with self.db.tx():
                for node_id in sorted(bad):
                    self.db.reject_submission(round_, node_id, Exclusion.BAD_DIGEST)
            for node_id in sorted(bad):
                log.info("event=submission_unconfirmed round=%d node=%s", round_, node_id)
        self.checks.settle(round_, checked | bad)
        return self._maybe_close(self.clock())

    def waited(self, round_: int) -> set[str]:
        """The members open round ``round_`` waits for before it may close early: not those
        silent for ``silent_rounds`` rounds, nor those that said they only observe (their link
        cannot get a payload in: ``NodeCondition.OBSERVING``)."""
        n = self.run.timing.silent_rounds
        recent = self.db.submitters(round_ - n, round_ - 1)
        everyone = self.members.members()
        observing = self.members.observing()
        members = [m for m in everyone if m.node_id not in observing]
        # A round of observers only waits for them all (to its deadline), never closes at once.
        return rounds.waited_set(members, round_, recent, n) or rounds.waited_set(
            everyone, round_, recent, n
        )

    def close(self, round_: int, now: float) -> SignedManifest:
        """Close open round ``round_`` in one transaction: decide, sign, store, start the next."""
        return self.closer.close(round_, now)

    # ---- manifests and reports -----------------------------------------------------------
    def manifest(self, round_: int) -> SignedManifest | None:
        """The signed manifest of closed ``round_``; ``None`` while it is waiting or open."""
        cur = self._current()  # in memory: the long-polls of the open round need no read
        if round_ == cur.round and cur.state != RoundState.CLOSED:
            return None
        row = self.db.get_round(round_)
        if row is None or round_ < 0:
            raise UnknownRound(round_)
        if row.state != RoundState.CLOSED or row.signed_manifest is None:
            return None
        return SignedManifest.model_validate_json(row.signed_manifest)

    def report(self, node_id: str, round_: int, report: RoundReport) -> bool:
        """Record a participant's report of closed ``round_`` (``Votes.record``); True if it is
        its first for it."""
        return self.votes.record(node_id, round_, report)
