"""The run as ``GET /v1/status`` shows it: the run config, the current round, every member
and the recent rounds with their nodes' reports, and the newest checkpoint.

Anyone may read it (no token): ``sparseloco up``, the dashboard and ``doctor`` draw from it.
"""

from __future__ import annotations

from pydantic import Field

from protocol.messages import (
    CheckpointInfo,
    MemberState,
    Message,
    NodeCondition,
    NodeId,
    RoundState,
)
from protocol.reports import RoundReport
from protocol.runconfig import RunConfig


class MemberView(Message):
    node_id: NodeId
    state: MemberState
    slot: int
    joined_round: int
    last_seen_s: float = Field(description="seconds since the last heartbeat")
    condition: NodeCondition | None = Field(
        None, description="what its last heartbeat said it was doing (absent: not said)"
    )


class WorkView(Message):
    """What one gathered payload carried (``node.compute.work``): its inner steps and tokens as
    the signed manifest lists them, and its share of the round's work (claims clamped to H)."""

    steps: int | None = None
    tokens: int | None = None
    share: float = Field(ge=0, le=1)


class RoundSummary(Message):
    round: int
    state: RoundState
    gather: list[str] = Field(default_factory=list)
    excluded: dict[str, str] = Field(default_factory=dict)
    base_fingerprint: str | None = None
    fingerprints: dict[str, str] = Field(default_factory=dict)
    reports: dict[str, RoundReport] = Field(default_factory=dict)
    duration_s: float | None = None
    budget_s: float | None = Field(None, description="the round's time budget, if it had one")
    work: dict[str, WorkView] = Field(
        default_factory=dict, description="per gathered node: the work its payload carried"
    )


class StatusView(Message):
    run_id: str
    run: RunConfig
    round: int
    state: RoundState
    members: list[MemberView]
    rounds: list[RoundSummary] = Field(description="recent rounds, newest last")
    checkpoint: CheckpointInfo | None = None
