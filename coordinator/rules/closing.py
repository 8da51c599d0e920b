"""The round machine's two transitions: a waiting round opens, an open round closes.

A round opens once ``min_nodes`` members are active, with a deadline learnt from how long the
recent rounds took to settle: from their opening to their last valid submission
(``rounds.settled_at``, ``rounds.deadline_length``), and a time budget learnt from how long its
members need for a whole round (``coordinator.rules.budget``). Closing round r is one transaction:
the gather set and exclusions decided by ``rounds.decide_close`` from the submissions, the
members and the base fingerprint the participants of the round it builds on reported; the
manifest signed and stored; round r+1 created, open at once if enough members are active, or
the run finished (every active member ``finished``) when r was its last round. When to close is
the machine's question (``coordinator.rules.deadlines``, ``coordinator.rules.progress``); this
is what a close does. Its log line, ``round_closed``, gives the round's number and ``done=N/R``:
how many of the run's R rounds are closed with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from coordinator.base.errors import Conflict
from coordinator.rules import budget, rounds
from coordinator.rules.membership import Membership
from coordinator.rules.votes import Votes
from coordinator.state.db import Database, RoundRow, SubmissionRow
from coordinator.state.signing import ManifestSigner
from protocol.keys import payload_key
from protocol.messages import Manifest, ManifestEntry, MemberState, RoundState, SignedManifest
from protocol.runconfig import RunConfig

log = logging.getLogger("sparseloco.coordinator.machine")


@dataclass(frozen=True)
class RoundCloser:
    """Opens and closes the rounds of one run over one ``Database``."""

    db: Database
    run: RunConfig
    signer: ManifestSigner
    members: Membership
    votes: Votes
    prefix: str
    #: Payload keys carry the payload's sha256 (``protocol.keys.payload_key``).
    digest_keys: bool = False

    def deadline_length(self) -> float:
        """Seconds the next round may take, learnt from the recent rounds."""
        durations = self.db.closed_durations(rounds.DEADLINE_HISTORY)
        return rounds.deadline_length(durations, self.run.timing)

    def budget_length(self) -> float | None:
        """The next round's time budget (``coordinator.rules.budget``), learnt from the recent
        rounds' arrivals of the members active now; None: no budget."""
        active = [m.node_id for m in self.members.members() if m.state == MemberState.ACTIVE]
        history = self.db.work_history(budget.HISTORY)
        return budget.budget_s(history, self.run.timing, self.run.inner_steps, active)

    def open_if_ready(self, cur: RoundRow, now: float) -> None:
        """Open ``cur`` if it is waiting and enough members are active (inside a transaction)."""
        if cur.state == RoundState.WAITING and self.members.active_count() >= self.run.min_nodes:
            length, allowed = self.deadline_length(), self.budget_length()
            self.db.open_round(cur.round, now, now + length, allowed)
            _log_opened(cur.round, length, allowed)

    def close(self, round_: int, now: float) -> SignedManifest:
        """Close open round ``round_`` in one transaction: decide, sign, store, start the next."""
        with self.db.tx():
            row = self.db.get_round(round_)
            if row is None or row.state != RoundState.OPEN or row.started_at is None:
                raise Conflict("round_closed", f"round {round_} is not open; it cannot close")
            rows = self.db.submissions(round_)
            voted = self.run.base_round(round_)
            reported = [] if voted is None else self.votes.reported(voted)
            decision = rounds.decide_close(
                [_rule_submission(s) for s in rows],
                self.members.members(),
                round_,
                reported,
                self.run.gather_size,
            )
            signed = self.signer.sign(self._manifest(round_, decision, row.started_at, now))
            settled = rounds.settled_at(decision, {s.node_id: s.at for s in rows}, now)
            if not self.db.close_round(
                round_, now, decision.base_fingerprint, signed.model_dump_json(), settled
            ):
                raise Conflict("round_closed", f"round {round_} closed concurrently")
            nxt = round_ + 1
            finished = 0
            opened: tuple[int, float, float | None] | None = None
            if nxt < self.run.rounds:
                if self.members.active_count() >= self.run.min_nodes:
                    length, allowed = self.deadline_length(), self.budget_length()
                    self.db.insert_round(nxt, RoundState.OPEN, now, now + length, allowed)
                    opened = (nxt, length, allowed)
                else:
                    self.db.insert_round(nxt, RoundState.WAITING, None, None)
            else:
                finished = self.members.finish(round_)
        log.info(
            "event=round_closed round=%d done=%d/%d gather=%d excluded=%d duration_s=%.2f"
            " settled_s=%.2f finished=%s",
            round_,
            nxt,
            self.run.rounds,
            len(decision.gather),
            len(decision.excluded),
            now - row.started_at,
            settled - row.started_at,
            nxt >= self.run.rounds,
        )
        if nxt >= self.run.rounds:
            log.info("event=run_finished rounds=%d members_finished=%d", nxt, finished)
        if opened is not None:
            _log_opened(*opened)
        return signed

    def _key(self, round_: int, node_id: str, sha256: str) -> str:
        named = sha256 if self.digest_keys else None
        return payload_key(self.prefix, self.run.run_id, round_, node_id, named)

    def _manifest(
        self, round_: int, decision: rounds.CloseDecision, opened_at: float, closed_at: float
    ) -> Manifest:
        run_id = self.run.run_id
        return Manifest(
            run_id=run_id,
            round=round_,
            base_fingerprint=decision.base_fingerprint,
            gather=[
                ManifestEntry(
                    node_id=s.node_id,
                    key=self._key(round_, s.node_id, s.sha256),
                    sha256=s.sha256,
                    size=s.size,
                    steps=s.steps,
                    tokens=s.tokens,
                )
                for s in decision.gather
            ],
            excluded={node: reason.value for node, reason in decision.excluded.items()},
            opened_at=opened_at,
            closed_at=closed_at,
        )


def _rule_submission(row: SubmissionRow) -> rounds.Submission:
    """A submissions row as the pure round rules take it."""
    return rounds.Submission(
        row.node_id, row.seq, row.sha256, row.size, row.base_fingerprint, row.rejected,
        row.steps, row.tokens,
    )  # fmt: skip


def _log_opened(round_: int, deadline_s: float, budget_s: float | None) -> None:
    budget_text = "-" if budget_s is None else f"{budget_s:.1f}"
    log.info(
        "event=round_opened round=%d deadline_s=%.1f budget_s=%s", round_, deadline_s, budget_text
    )
