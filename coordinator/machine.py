"""The round state machine: membership, submissions, opening and closing rounds.

This is the coordinator's core, synchronous and free of HTTP: every method reads the database,
applies the rules of ``coordinator.rounds`` and commits one transaction. The clock is injected,
so tests drive time by hand. Methods that may close rounds return the newly closed rounds' signed
manifests; the caller wakes waiters, counts metrics and hands them to the publisher.

Round life: ``waiting`` (fewer active members than ``min_nodes``) -> ``open`` (with a deadline)
-> ``closed`` (manifest signed, stored). Closing round r creates r+1, open at once if enough
members are active; closing the run's last round finishes the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from coordinator import rounds
from coordinator.db import Database, MemberRow, RoundRow, SubmissionRow
from coordinator.signing import ManifestSigner
from coordinator.status import build_status
from protocol.errors import ConfigError, SparseLoCoError
from protocol.keys import payload_key
from protocol.messages import (
    Exclusion,
    Manifest,
    ManifestEntry,
    MemberState,
    RoundReport,
    RoundState,
    RoundView,
    SignedManifest,
    StatusView,
    SubmitRequest,
    SubmitResponse,
)
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.coordinator.machine")


class RoundError(SparseLoCoError):
    """A request that the round state does not allow; ``code`` is the API error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class UnknownRound(RoundError, LookupError):
    def __init__(self, round_: int) -> None:
        super().__init__("unknown_round", f"round {round_} does not exist (yet)")


class Conflict(RoundError):
    """The request is well formed but conflicts with the state (HTTP 409)."""


class RoundMachine:
    """Membership and rounds over one ``Database``; one instance per coordinator process."""

    def __init__(
        self,
        db: Database,
        run: RunConfig,
        signer: ManifestSigner,
        *,
        prefix: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.db = db
        self.run = run
        self.run_id = run.run_id
        self.signer = signer
        self.prefix = prefix
        self.clock = clock
        #: Last heartbeat per member (wall clock). Not persisted: a restart gives everyone a
        #: fresh window, so nobody times out because the coordinator was down.
        self.last_seen: dict[str, float] = {}
        self._start()

    def _start(self) -> None:
        stored = self.db.get_meta("run_id")
        if stored is not None and stored != self.run_id:
            raise ConfigError(
                f"state dir {self.db.path.parent} belongs to run {stored}, not {self.run_id};"
                " use a new --state-dir or the same config"
            )
        now = self.clock()
        with self.db.tx():
            if stored is None:
                self.db.set_meta("run_id", self.run_id)
                self.db.set_meta("run_config", self.run.canonical().decode())
                self.db.insert_round(0, RoundState.WAITING, None, None)
                log.info("event=run_created run=%s", self.run_id)
        for member in self.db.members():
            if member.state == MemberState.ACTIVE:
                self.last_seen[member.node_id] = now
        cur = self._current()
        log.info("event=state_loaded run=%s round=%d state=%s", self.run_id, cur.round, cur.state)

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
        return self.run.rounds if self.finished() else self._current().round

    def _members(self) -> list[rounds.Member]:
        return [_member(m) for m in self.db.members()]

    def round_view(self, node_id: str) -> RoundView:
        """The current round as ``node_id`` sees it."""
        cur = self._current()
        if cur.state == RoundState.CLOSED:
            return RoundView(
                run_id=self.run_id,
                round=self.run.rounds,
                state=RoundState.FINISHED,
                expected=False,
                last_closed=cur.round,
            )
        member = self.db.member(node_id)
        expected = (
            cur.state == RoundState.OPEN
            and member is not None
            and rounds.is_expected(_member(member), cur.round)
        )
        deadline_in_s = None
        if cur.state == RoundState.OPEN and cur.deadline is not None:
            deadline_in_s = max(0.0, cur.deadline - self.clock())
        return RoundView(
            run_id=self.run_id,
            round=cur.round,
            state=cur.state,
            expected=expected,
            submitted=self.db.submission(cur.round, node_id) is not None,
            deadline_in_s=deadline_in_s,
            last_closed=cur.round - 1,
        )

    # ---- membership ----------------------------------------------------------------------
    def join(self, node_id: str, client: str = "") -> int:
        """Make ``node_id`` an active member (it may open a waiting round); returns its slot."""
        now = self.clock()
        with self.db.tx():
            cur = self._current()
            if cur.state == RoundState.CLOSED:
                joined = self.run.rounds
            else:
                has_subs = self.db.count_submissions(cur.round) > 0
                joined = rounds.joined_round_for(cur.state, cur.round, has_subs)
            member = self.db.member(node_id)
            if member is None:
                slot = self.db.add_member(node_id, joined, client)
            else:
                slot = member.slot
                if member.state == MemberState.ACTIVE and member.joined_round <= cur.round:
                    joined = member.joined_round
                self.db.set_member(node_id, MemberState.ACTIVE, joined, None)
            self.last_seen[node_id] = now
            self._maybe_open(now)
        log.info(
            "event=joined node=%s slot=%d joined_round=%d round=%d returning=%s",
            node_id,
            slot,
            joined,
            cur.round,
            member is not None,
        )
        return slot

    def heartbeat(self, node_id: str) -> RoundView:
        member = self.db.member(node_id)
        if member is None or member.state != MemberState.ACTIVE:
            raise Conflict("not_member", f"{node_id} is not an active member; join again")
        self.last_seen[node_id] = self.clock()
        return self.round_view(node_id)

    def leave(self, node_id: str) -> list[SignedManifest]:
        """Mark ``node_id`` as left; an open round no longer waits for it."""
        member = self.db.member(node_id)
        if member is None:
            raise Conflict("not_member", f"{node_id} never joined")
        with self.db.tx():
            cur = self._current()
            self.db.set_member(node_id, MemberState.LEFT, member.joined_round, cur.round)
        self.last_seen.pop(node_id, None)
        log.info("event=left node=%s round=%d", node_id, cur.round)
        return self._maybe_close(self.clock())

    def tick(self) -> list[SignedManifest]:
        """Time out silent members, open a waiting round, close an overdue one."""
        now = self.clock()
        limit = now - self.run.timing.heartbeat_timeout_s
        cur = self._current()
        for member in self.db.members():
            if member.state != MemberState.ACTIVE:
                continue
            seen = self.last_seen.setdefault(member.node_id, now)
            if seen < limit:
                with self.db.tx():
                    self.db.set_member(
                        member.node_id, MemberState.TIMED_OUT, member.joined_round, cur.round
                    )
                self.last_seen.pop(member.node_id, None)
                log.warning(
                    "event=timed_out node=%s round=%d silent_s=%.1f",
                    member.node_id,
                    cur.round,
                    now - seen,
                )
        with self.db.tx():
            self._maybe_open(now)
        return self._maybe_close(now)

    # ---- submissions ---------------------------------------------------------------------
    def check_submittable(self, node_id: str, round_: int) -> None:
        """Raise unless ``node_id`` may upload to / submit for ``round_`` now."""
        cur = self._current()
        if round_ > cur.round or (cur.state == RoundState.CLOSED and round_ >= self.run.rounds):
            raise UnknownRound(round_)
        if round_ < cur.round or cur.state != RoundState.OPEN:
            raise Conflict("round_closed", f"round {round_} is not open for submissions")
        member = self.db.member(node_id)
        if member is None or not rounds.is_expected(_member(member), round_):
            raise Conflict("not_expected", f"{node_id} is not expected in round {round_}")

    def previous_submission(
        self, node_id: str, round_: int, req: SubmitRequest
    ) -> SubmitResponse | None:
        """The answer already given to this submission (a retry), or ``None`` if it is new.

        A retry is answered even after the round closed (the first answer may have been lost).
        A different submission is refused: ``round_closed`` if the round is over, else
        ``already_submitted`` (payloads are write-once).
        """
        prior = self.db.submission(round_, node_id)
        if prior is None:
            return None
        same = (prior.size, prior.sha256, prior.base_fingerprint) == (
            req.size,
            req.sha256,
            req.base_fingerprint,
        )
        if not same:
            self.check_submittable(node_id, round_)  # a closed round says so first
            raise Conflict(
                "already_submitted", f"{node_id} already submitted a different payload to {round_}"
            )
        return _response(prior)

    def expected_base(self, round_: int) -> str | None:
        """The base fingerprint round ``round_`` must use, if the reports already settle it."""
        if round_ == 0:
            return None
        return rounds.majority(self.db.reported_fingerprints(round_ - 1))

    def submit(
        self, node_id: str, round_: int, req: SubmitRequest, digest_ok: bool
    ) -> tuple[SubmitResponse, list[SignedManifest]]:
        """Record a submission (``digest_ok``: the stored object matches size and sha256)."""
        with self.db.tx():
            prior = self.previous_submission(node_id, round_, req)
            if prior is not None:
                return prior, []
            self.check_submittable(node_id, round_)
            rejected: Exclusion | None = None
            base = self.expected_base(round_)
            if not digest_ok:
                rejected = Exclusion.BAD_DIGEST
            elif base is not None and req.base_fingerprint != base:
                rejected = Exclusion.WRONG_BASE
            seq = self.db.add_submission(
                round_, node_id, req.size, req.sha256, req.base_fingerprint, rejected
            )
        log.info(
            "event=submitted round=%d node=%s seq=%d rejected=%s",
            round_,
            node_id,
            seq,
            "-" if rejected is None else rejected.name,
        )
        accepted = rejected is None
        reason = None if rejected is None else rejected.value
        return SubmitResponse(accepted=accepted, reason=reason), self._maybe_close(self.clock())

    # ---- opening and closing -------------------------------------------------------------
    def _active_count(self) -> int:
        return sum(1 for m in self.db.members() if m.state == MemberState.ACTIVE)

    def _deadline_length(self) -> float:
        durations = self.db.closed_durations(rounds.DEADLINE_HISTORY)
        return rounds.deadline_length(durations, self.run.timing)

    def _maybe_open(self, now: float) -> None:
        cur = self._current()
        if cur.state == RoundState.WAITING and self._active_count() >= self.run.min_nodes:
            length = self._deadline_length()
            self.db.open_round(cur.round, now, now + length)
            log.info("event=round_opened round=%d deadline_s=%.1f", cur.round, length)

    def _maybe_close(self, now: float) -> list[SignedManifest]:
        closed: list[SignedManifest] = []
        # Closing creates the next round, which cannot be closable at once (its expected
        # members have not submitted yet); the bound only guards against a logic error.
        for _ in range(2):
            cur = self._current()
            if cur.state != RoundState.OPEN or cur.deadline is None:
                break
            expected = rounds.expected_set(self._members(), cur.round)
            submitted = [s.node_id for s in self.db.submissions(cur.round)]
            if not rounds.should_close(expected, submitted, now, cur.deadline):
                break
            closed.append(self.close(cur.round, now))
        return closed

    def close(self, round_: int, now: float) -> SignedManifest:
        """Close open round ``round_`` in one transaction: decide, sign, store, start the next."""
        with self.db.tx():
            row = self.db.get_round(round_)
            if row is None or row.state != RoundState.OPEN or row.started_at is None:
                raise Conflict("round_closed", f"round {round_} is not open; it cannot close")
            subs = [_submission(s) for s in self.db.submissions(round_)]
            reported = self.db.reported_fingerprints(round_ - 1) if round_ > 0 else []
            decision = rounds.decide_close(
                subs, self._members(), round_, reported, self.run.gather_size
            )
            manifest = Manifest(
                run_id=self.run_id,
                round=round_,
                base_fingerprint=decision.base_fingerprint,
                gather=[
                    ManifestEntry(
                        node_id=s.node_id,
                        key=payload_key(self.prefix, self.run_id, round_, s.node_id),
                        sha256=s.sha256,
                        size=s.size,
                    )
                    for s in decision.gather
                ],
                excluded={node: reason.value for node, reason in decision.excluded.items()},
                opened_at=row.started_at,
                closed_at=now,
            )
            signed = self.signer.sign(manifest)
            if not self.db.close_round(
                round_, now, decision.base_fingerprint, signed.model_dump_json()
            ):
                raise Conflict("round_closed", f"round {round_} closed concurrently")
            nxt = round_ + 1
            if nxt < self.run.rounds:
                if self._active_count() >= self.run.min_nodes:
                    length = self._deadline_length()
                    self.db.insert_round(nxt, RoundState.OPEN, now, now + length)
                else:
                    self.db.insert_round(nxt, RoundState.WAITING, None, None)
        log.info(
            "event=round_closed round=%d gather=%d excluded=%d duration_s=%.2f finished=%s",
            round_,
            len(decision.gather),
            len(decision.excluded),
            now - row.started_at,
            nxt >= self.run.rounds,
        )
        return signed

    # ---- manifests and reports -----------------------------------------------------------
    def manifest(self, round_: int) -> SignedManifest | None:
        """The signed manifest of closed ``round_``; ``None`` while it is waiting or open."""
        row = self.db.get_round(round_)
        if row is None or round_ < 0:
            raise UnknownRound(round_)
        if row.state != RoundState.CLOSED or row.signed_manifest is None:
            return None
        return SignedManifest.model_validate_json(row.signed_manifest)

    def report(self, node_id: str, round_: int, report: RoundReport) -> None:
        row = self.db.get_round(round_)
        if row is None:
            raise UnknownRound(round_)
        if row.state != RoundState.CLOSED:
            raise Conflict("round_open", f"round {round_} is not closed yet; report after it")
        with self.db.tx():
            self.db.record_report(round_, node_id, report.fingerprint, report.model_dump_json())
        log.info(
            "event=reported round=%d node=%s fingerprint=%s", round_, node_id, report.fingerprint
        )

    def status(self, n_rounds: int) -> StatusView:
        """The whole run for dashboards: members and the newest ``n_rounds`` rounds."""
        return build_status(self, n_rounds)


def _member(row: MemberRow) -> rounds.Member:
    return rounds.Member(row.node_id, row.state, row.joined_round, row.gone_in_round)


def _submission(row: SubmissionRow) -> rounds.Submission:
    return rounds.Submission(
        row.node_id, row.seq, row.sha256, row.size, row.base_fingerprint, row.rejected
    )


def _response(row: SubmissionRow) -> SubmitResponse:
    if row.rejected is None:
        return SubmitResponse(accepted=True)
    return SubmitResponse(accepted=False, reason=row.rejected.value)
