"""The coordinator database's rows as frozen values: what ``coordinator.state.db`` reads return.

Kept apart from the reads and writes so each reads in one place; ``coordinator.state.db`` re-exports
them, so callers import them from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.messages import CheckpointInfo, CheckpointUpload, Exclusion, MemberState, RoundState


@dataclass(frozen=True)
class MemberRow:
    node_id: str
    slot: int
    state: MemberState
    joined_round: int
    gone_in_round: int | None
    #: The process the member was bound to at its last join (``None``: it sent no instance id).
    instance: str | None = None


@dataclass(frozen=True)
class RoundRow:
    round: int
    state: RoundState
    started_at: float | None
    deadline: float | None
    closed_at: float | None
    base_fingerprint: str | None
    signed_manifest: str | None
    published: bool
    #: The round's time budget in seconds from its opening (``coordinator.rules.budget``);
    #: None: no budget (nodes train H steps).
    budget: float | None = None


@dataclass(frozen=True)
class GrantRow:
    round: int
    node_id: str
    body: CheckpointUpload
    expires_at: float


@dataclass(frozen=True)
class CheckpointRow:
    info: CheckpointInfo
    published: bool
    pruned: bool
    #: The coordinator checked the file's fingerprint before committing it (every commit since
    #: schema version 3; older ones were checked by HEAD only).
    verified: bool = True


@dataclass(frozen=True)
class SubmissionRow:
    round: int
    node_id: str
    seq: int
    size: int
    sha256: str
    base_fingerprint: str
    rejected: Exclusion | None
    #: When it arrived (wall clock); ``None`` for submissions recorded before schema version 3.
    at: float | None = None
    #: The work the payload carries, as submitted (``None``: not said: the run's H).
    steps: int | None = None
    tokens: int | None = None
