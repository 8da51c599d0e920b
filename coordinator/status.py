"""The run's status for dashboards and operators (``GET /v1/status``).

Built from the database on request: every member with its state and heartbeat age, the
newest rounds, each closed one with its gather set, exclusions, base fingerprint, the nodes'
reports and how long it took, and the newest committed checkpoint. Kept apart from the round
machine because it only reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coordinator.db import RoundRow
from protocol.messages import (
    MemberView,
    RoundReport,
    RoundState,
    RoundSummary,
    SignedManifest,
    StatusView,
)

if TYPE_CHECKING:
    from coordinator.machine import RoundMachine


def build_status(machine: RoundMachine, n_rounds: int) -> StatusView:
    """Members and the newest ``n_rounds`` rounds (oldest first) of ``machine``'s run."""
    now = machine.clock()
    members = [
        MemberView(
            node_id=m.node_id,
            state=m.state,
            slot=m.slot,
            joined_round=m.joined_round,
            last_seen_s=max(0.0, now - machine.last_seen.get(m.node_id, now)),
        )
        for m in machine.db.members()
    ]
    summaries = [round_summary(machine, row) for row in machine.db.recent_rounds(n_rounds)]
    current = machine.db.current_round()
    state = RoundState.WAITING if current is None else current.state
    return StatusView(
        run_id=machine.run_id,
        run=machine.run,
        round=machine.round_number(),
        state=RoundState.FINISHED if state == RoundState.CLOSED else state,
        members=members,
        rounds=summaries,
        checkpoint=machine.db.newest_checkpoint(),
    )


def round_summary(machine: RoundMachine, row: RoundRow) -> RoundSummary:
    """One round as the status shows it; only closed rounds have a gather set."""
    reports = {
        node: RoundReport.model_validate(body)
        for node, body in machine.db.reports(row.round).items()
    }
    if row.state != RoundState.CLOSED or row.signed_manifest is None:
        return RoundSummary(round=row.round, state=row.state)
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
    )
