"""The coordinator's HTTP API as pydantic models: what node and coordinator say to each other.

Every request body is validated with these models (unknown fields are rejected), and every
response is built from them, so both sides share one definition and the OpenAPI document is
generated from the same source. Endpoints (all under ``/v1``, bearer-token auth)::

    POST /v1/join                       JoinRequest        -> JoinResponse
    POST /v1/heartbeat                  HeartbeatRequest?  -> RoundView
    POST /v1/leave                                         -> Ack
    GET  /v1/round                                         -> RoundView
    POST /v1/rounds/{r}/upload          UploadRequest      -> UploadGrant
    POST /v1/rounds/{r}/upload/complete UploadComplete -> UploadDone (multipart only)
    POST /v1/rounds/{r}/submit          SubmitRequest      -> SubmitResponse
    GET  /v1/rounds/{r}/manifest?wait=s                    -> ManifestView (202 RoundView if open)
    POST /v1/rounds/{r}/report          RoundReport        -> Ack
    POST /v1/checkpoints/{R}/upload     CheckpointUpload   -> UploadGrant (409 not_needed)
    POST /v1/checkpoints/{R}/upload/complete UploadComplete -> UploadDone (multipart only)
    POST /v1/checkpoints/{R}/commit     CheckpointUpload   -> CheckpointInfo
    GET  /v1/checkpoints/latest                            -> CheckpointView (404 no_checkpoint)
    GET  /v1/checkpoints                                   -> CheckpointList (newest first)
    GET  /v1/status                                        -> StatusView

Every node request also names its process in the ``X-Sparseloco-Instance`` header (a random id
drawn at its start): while a member is active it is bound to that process, and a second process
with the same token is refused with 409 ``token_in_use`` instead of silently taking its place.
A process restarted on the same state directory names its predecessor at join
(``previous_instance``) and takes over at once.

A ``Manifest`` is the record of one closed round. The coordinator signs its canonical JSON
with Ed25519 (``protocol.signing``) and stores ``SignedManifest`` in the object store; nodes
verify the signature with the public key they received at join. The route table itself (method,
path, request and response models of each endpoint) is ``protocol.routes``. Three bodies have
their own modules: a node's ``RoundReport`` (``protocol.reports``), the ``StatusView``
(``protocol.status``) and the dataset's (``protocol.dataset``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from protocol.keys import ID_PATTERN
from protocol.parts import MultipartGrant, PartPlan
from protocol.runconfig import RunConfig

MANIFEST_VERSION = 1

NodeId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
FingerprintHex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]

# Numbers in request bodies keep their JSON type (``strict``) and have a range; the report's
# (``protocol.reports``) say why.
#: Largest object (payload, checkpoint) size a body may name: 1 TiB; the coordinator's
#: configured limits are far lower and answer 413 above them.
MAX_OBJECT_BYTES = 1 << 40

ObjectSize = Annotated[int, Field(strict=True, gt=0, le=MAX_OBJECT_BYTES)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RoundState(StrEnum):
    WAITING = "waiting"  # fewer active members than the run's minimum; nothing trains yet
    OPEN = "open"  # accepting submissions until every expected node submitted or the deadline
    CLOSED = "closed"
    FINISHED = "finished"  # the run's last round has closed


class Exclusion(StrEnum):
    """Why a node is not in a round's gather set (the manifest's ``excluded`` values)."""

    MISSED_DEADLINE = "missed deadline"
    BAD_DIGEST = "bad digest"
    WRONG_BASE = "wrong base fingerprint"
    OVER_LIMIT = "over limit"
    LEFT = "left"
    TIMED_OUT = "timed out"
    REVOKED = "revoked"  # the operator revoked the node's token during the round


class MemberState(StrEnum):
    ACTIVE = "active"
    LEFT = "left"
    TIMED_OUT = "timed out"
    REVOKED = "revoked"  # the operator revoked its token; it takes no further part
    FINISHED = "finished"  # took part until the run's last round closed


#: The header every node request carries: a random id of the process, drawn at its start, so
#: the coordinator can tell a second process using the same token from the first one.
INSTANCE_HEADER = "X-Sparseloco-Instance"
INSTANCE_PATTERN = r"^[A-Za-z0-9_-]{8,64}$"
InstanceId = Annotated[str, StringConstraints(pattern=INSTANCE_PATTERN)]
#: A header any request of a member may carry: what the node is doing as it sends it (a
#: ``NodeCondition``). A coordinator that counted the request as a heartbeat answers with
#: ``HEARD_HEADER`` naming the condition it now holds for the node (the one said, except that a
#: manifest handed out makes it ``training``: the node applies it, then trains), so the node
#: need not beat while it talks anyway; one that does not know the header ignores it, and the
#: node keeps beating.
CONDITION_HEADER = "X-Sparseloco-Condition"
HEARD_HEADER = "X-Sparseloco-Heard"


class JoinRequest(Message):
    client: str = Field("", max_length=128, description="free-form client name and version")
    instance: InstanceId | None = Field(
        None,
        description="random id of the joining process (also sent as the X-Sparseloco-Instance"
        " header); a member is bound to it while it is active",
    )
    previous_instance: InstanceId | None = Field(
        None,
        description="the instance that ran on this node's state directory before this process"
        " (a restart after a crash): it may take over its membership at once",
    )


class NodeCondition(StrEnum):
    """What a node is doing, as its heartbeats say (``HeartbeatRequest``).

    The coordinator keeps a round that nobody has submitted to open past its deadline while a
    member is ``training`` or ``store_unreachable`` (``coordinator.rules.rounds.held``): closing it
    would aggregate nothing and spend one of the run's rounds.
    """

    TRAINING = "training"  # working toward its submission: training, or applying rounds first
    WAITING = "waiting"  # idle: submitted and waiting for the round to close, or for members
    STORE_UNREACHABLE = "store_unreachable"  # its uploads or downloads cannot reach the store
    #: Its link cannot get a payload in within the round's budget: it applies every round and
    #: submits none, so no round waits for it (``node.compute.linkbudget``).
    OBSERVING = "observing"


class HeartbeatRequest(Message):
    """The optional body of a heartbeat; an empty body (a node older than it) is accepted."""

    condition: NodeCondition | None = Field(None, description="what the node is doing now")


class RoundView(Message):
    """The current round as one node sees it."""

    run_id: str
    round: int = Field(ge=0, description="the round now in progress (or the run's length)")
    state: RoundState
    expected: bool = Field(description="whether this node is expected to submit to this round")
    submitted: bool = False
    deadline_in_s: float | None = None
    last_closed: int = Field(-1, ge=-1, description="the newest closed round, -1 if none")
    budget_s: float | None = Field(
        None,
        ge=0,
        description="the round's time budget, from its opening (``coordinator.rules.budget``):"
        " a node fits its training, encode and upload into it; None: train H steps",
    )
    budget_in_s: float | None = Field(
        None, ge=0, description="seconds left of the budget when this view was made"
    )


class JoinResponse(Message):
    node_id: NodeId
    run_id: str
    run: RunConfig
    slot: int = Field(ge=0, description="this node's data stream, in join order")
    manifest_public_key: str = Field(description="hex Ed25519 key that signs manifests")
    heartbeat_interval_s: float = Field(gt=0)
    round: RoundView


class UploadRequest(Message):
    size: ObjectSize = Field(description="payload bytes")
    sha256: Sha256Hex
    parts: PartPlan | None = Field(
        None,
        description="ask for a multipart upload cut this way (``protocol.parts``); a coordinator"
        " whose store cannot do one answers a single PUT",
    )


class UploadGrant(Message):
    """A presigned PUT for this node's own payload key only, bound to the size and checksum;
    or, with ``multipart``, one presigned part upload per part (``url`` is then empty)."""

    key: str
    url: str
    headers: dict[str, str] = Field(description="headers the PUT must send exactly")
    expires_in_s: float
    multipart: MultipartGrant | None = None


#: Largest probe object ``sparseloco doctor`` may move through the store.
MAX_PROBE_BYTES = 16 << 20


class ProbeRequest(Message):
    """A node asking to test its path to the store with a throwaway object."""

    size: int = Field(strict=True, gt=0, le=MAX_PROBE_BYTES, description="probe bytes")
    sha256: Sha256Hex


class ProbeGrant(Message):
    """A presigned PUT and GET of this node's probe object (``runs/{run}/probes/{node}.bin``)."""

    key: str
    put_url: str
    put_headers: dict[str, str] = Field(description="headers the PUT must send exactly")
    get_url: str
    expires_in_s: float


#: Most inner steps a submission may say it carries (the run's H bounds what counts far lower).
MAX_STEPS = (1 << 32) - 1
#: Most tokens it may say (exact in a float64 and in JSON).
MAX_TOKENS = (1 << 53) - 1
Steps = Annotated[int, Field(strict=True, ge=1, le=MAX_STEPS)]
Tokens = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKENS)]


class SubmitRequest(Message):
    size: ObjectSize
    sha256: Sha256Hex
    base_fingerprint: FingerprintHex = Field(description="fingerprint of the θ it trained from")
    steps: Steps | None = Field(
        None,
        description="inner steps the payload carries, as its header says (None: the run's H);"
        " what counts in the aggregate is at most H (``node.compute.work``)",
    )
    tokens: Tokens | None = Field(None, description="tokens those steps read")


class SubmitResponse(Message):
    accepted: bool
    reason: str | None = None


class ManifestEntry(Message):
    node_id: NodeId
    key: str
    sha256: Sha256Hex
    size: int = Field(gt=0)
    #: The work the payload carries, as its node submitted it and its header says; every node
    #: aggregates by these (``node.compute.work``). None in a manifest that does not say.
    steps: int | None = Field(None, ge=1)
    tokens: int | None = Field(None, ge=0)


class Manifest(Message):
    """One closed round: who is aggregated (in canonical order) and who is not, and why."""

    version: int = MANIFEST_VERSION
    run_id: str
    round: int = Field(ge=0)
    base_fingerprint: FingerprintHex | None = Field(
        description="fingerprint of θ_round every gathered payload was trained from"
    )
    gather: list[ManifestEntry] = Field(description="sorted by node id")
    excluded: dict[str, str] = Field(description="node id -> reason")
    opened_at: float
    closed_at: float

    def steps(self) -> dict[str, int | None]:
        """The steps each gathered payload carries, as listed (None: not said)."""
        return {e.node_id: e.steps for e in self.gather}


class SignedManifest(Message):
    """A manifest as stored at ``rounds/{r}/manifest.json``."""

    manifest: Manifest
    signature: str = Field(pattern=r"^[0-9a-f]{128}$", description="hex Ed25519 signature")


class ManifestView(Message):
    """A closed round for a node: the signed manifest and presigned GETs for the gather set."""

    signed: SignedManifest
    urls: dict[str, str] = Field(description="node id -> presigned GET of its payload")


class Ack(Message):
    ok: bool = True


class CheckpointUpload(Message):
    """A node offering θ_R (the parameters at the start of round R) as a checkpoint."""

    size: ObjectSize = Field(description="bytes of the safetensors file")
    sha256: Sha256Hex
    fingerprint: FingerprintHex = Field(description="fingerprint of the parameters in the file")
    parts: PartPlan | None = Field(
        None, description="ask for a multipart upload cut this way (``protocol.parts``)"
    )


class CheckpointInfo(Message):
    """An accepted checkpoint: ``checkpoints/latest.json`` and each ``model.json`` sidecar."""

    run_id: str
    round: int = Field(ge=0, description="θ at the start of this round")
    fingerprint: FingerprintHex
    key: str
    sha256: Sha256Hex
    size: int = Field(gt=0)
    node_id: NodeId = Field(description="who uploaded it")
    created_at: float


class CheckpointView(Message):
    info: CheckpointInfo
    url: str = Field(description="presigned GET of the safetensors file")


class CheckpointList(Message):
    """Every committed checkpoint still in the store, newest first: a node that cannot use the
    newest one (its download fails, or its fingerprint does not check out) falls back to the
    next. Every one was verified by the coordinator before it was committed."""

    checkpoints: list[CheckpointView]


class ErrorBody(Message):
    """Every error response: a short machine-readable code, a message, and the field if any."""

    error: str
    message: str
    field: str | None = None
