"""The run's status for dashboards and operators (``GET /v1/status``).

Built from the database on request: every member with its state and heartbeat age, the
newest rounds, each closed one with its gather set, exclusions, base fingerprint, the nodes'
reports and how long it took, and the newest committed checkpoint. It only reads, so it takes
the database, the run config, the members' last heartbeats and the time as plain values and
knows nothing of the round machine that writes them.

Reports are validated on the way in, but a stored one may predate a tighter wire model (or the
rule that refuses non-finite numbers); such a report is left out of the view and logged once,
never allowed to fail the status for everyone.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from pydantic import ValidationError

from coordinator.rules import rounds
from coordinator.state.db import Database, RoundRow
from protocol.messages import ManifestEntry, NodeCondition, RoundState, SignedManifest
from protocol.reports import RoundReport
from protocol.runconfig import RunConfig
from protocol.status import MemberView, RoundSummary, StatusView, WorkView
from protocol.work import work_shares

log = logging.getLogger("sparseloco.coordinator.status")

#: (round, node) of stored reports that no longer validate, each logged once.
_unreadable: set[tuple[int, str]] = set()


def build_status(
    db: Database,
    run: RunConfig,
    *,
    last_seen: Mapping[str, float],
    now: float,
    n_rounds: int,
    conditions: Mapping[str, NodeCondition | None] | None = None,
) -> StatusView:
    """Members and the newest ``n_rounds`` rounds (oldest first) of ``run``.

    ``last_seen`` maps each active member to its last heartbeat (wall clock, like ``now``);
    ``conditions`` to what that heartbeat said it was doing.
    """
    conditions = conditions or {}
    members = [
        MemberView(
            node_id=m.node_id,
            state=m.state,
            slot=m.slot,
            joined_round=m.joined_round,
            last_seen_s=max(0.0, now - last_seen.get(m.node_id, now)),
            condition=conditions.get(m.node_id),
        )
        for m in db.members()
    ]
    summaries = [round_summary(db, row, run.inner_steps) for row in db.recent_rounds(n_rounds)]
    current = db.current_round()
    if current is None:  # not reached: the round machine creates round 0 with the run
        number, state = 0, RoundState.WAITING
    else:
        number, state = rounds.in_progress(current.round, current.state, run.rounds)
    return StatusView(
        run_id=run.run_id,
        run=run,
        round=number,
        state=state,
        members=members,
        rounds=summaries,
        checkpoint=db.newest_checkpoint(),
    )


def round_summary(db: Database, row: RoundRow, inner_steps: int) -> RoundSummary:
    """One round as the status shows it; only closed rounds have a gather set."""
    reports = readable_reports(db, row.round)
    if row.state != RoundState.CLOSED or row.signed_manifest is None:
        return RoundSummary(round=row.round, state=row.state, budget_s=row.budget)
    manifest = SignedManifest.model_validate_json(row.signed_manifest).manifest
    duration = None
    if row.closed_at is not None and row.started_at is not None:
        duration = row.closed_at - row.started_at
    return RoundSummary(
        round=row.round,
        state=row.state,
        gather=[e.node_id for e in manifest.gather],
        excluded=manifest.excluded,
        base_fingerprint=manifest.base_fingerprint,
        fingerprints={node: r.fingerprint for node, r in reports.items()},
        reports=reports,
        duration_s=duration,
        budget_s=row.budget,
        work=work_views(manifest.gather, inner_steps),
    )


def work_views(gather: list[ManifestEntry], inner_steps: int) -> dict[str, WorkView]:
    """Per gathered node, its steps and tokens and its share of the round's work."""
    steps = {e.node_id: e.steps for e in gather}
    shares = work_shares(steps, inner_steps)
    return {
        e.node_id: WorkView(steps=e.steps, tokens=e.tokens, share=shares.get(e.node_id, 0.0))
        for e in gather
    }


def readable_reports(db: Database, round_: int) -> dict[str, RoundReport]:
    """The stored reports of ``round_`` that validate as ``RoundReport``, by node."""
    out: dict[str, RoundReport] = {}
    for node, body in db.reports(round_).items():
        try:
            out[node] = RoundReport.model_validate(body)
        except ValidationError as exc:
            if (round_, node) not in _unreadable:
                _unreadable.add((round_, node))
                log.warning(
                    "event=report_unreadable round=%d node=%s error=%s",
                    round_,
                    node,
                    str(exc).splitlines()[0],
                )
    return out
