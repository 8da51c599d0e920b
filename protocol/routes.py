"""The coordinator's HTTP API as one route table: the wire contract's other half.

``protocol.messages`` says what each body holds; this table says where it goes. Every endpoint
has a name, a method, a path (``{round}`` stands for a round number), its request and response
models, whether it needs the bearer token, its query parameters and the error statuses it may
answer. Three users read it and none re-types a path:

- the coordinator registers one handler per entry, by ``name`` (``coordinator/api/app.py``);
- the coordinator's OpenAPI document is generated from it (``coordinator/api/openapi.py``);
- the node's client builds every request from it (``node/daemon/client.py``).

Every authenticated endpoint may also answer 401 ``token_revoked`` (the operator revoked the
token), 409 ``token_in_use`` (another process holds this node's membership), 422 for a
malformed ``X-Sparseloco-Instance`` header and 429 ``rate_limited`` (too many failed
authentications from the address, or requests from the node; with ``Retry-After``); every
endpoint with a body may answer 400 (not JSON, or empty), 408 (the body did not arrive in time),
413 and 422; every endpoint with a round in its path 404 (no such round, or not a round number);
every endpoint with query parameters 422. ``Endpoint.errors`` adds these to the statuses a row
names itself (``more_errors``: 404 for something missing, 503 when it needs the object store).
Query parameters are declared with their type and range (``Query``): a value outside it is
refused with 422, never clamped in silence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel

from protocol.dataset import DatasetFiles, DatasetFilesRequest, DatasetView
from protocol.messages import (
    Ack,
    CheckpointInfo,
    CheckpointList,
    CheckpointUpload,
    CheckpointView,
    HeartbeatRequest,
    JoinRequest,
    JoinResponse,
    ManifestView,
    ProbeGrant,
    ProbeRequest,
    RoundView,
    SubmitRequest,
    SubmitResponse,
    UploadGrant,
    UploadRequest,
)
from protocol.parts import MAX_PARTS_BODY_BYTES, UploadComplete, UploadDone
from protocol.reports import RoundReport
from protocol.status import StatusView

#: The placeholder for a round number in a path.
ROUND = "{round}"
#: Largest round number a path may carry (18 digits: what the coordinator's router matches).
MAX_ROUND = 10**18 - 1
#: Most rounds one ``GET /v1/status`` may ask for (the status is built on request, unauthenticated).
MAX_STATUS_ROUNDS = 1000
#: What an endpoint that needs the bearer token may answer: unknown or revoked token, the
#: membership held by another process, a malformed instance header, too many requests.
AUTH_ERRORS = frozenset({401, 409, 422, 429})
#: What an endpoint with a request body may answer: not JSON, too slow, too large, invalid.
BODY_ERRORS = frozenset({400, 408, 413, 422})


@dataclass(frozen=True)
class Query:
    """One query parameter: what it means, its JSON type (``integer`` or ``number``) and range."""

    description: str
    type: str = "number"
    minimum: float = 0
    maximum: float = 0

    def schema(self) -> dict[str, object]:
        """The parameter's JSON schema, as the OpenAPI document declares it."""
        lo: float = int(self.minimum) if self.type == "integer" else self.minimum
        hi: float = int(self.maximum) if self.type == "integer" else self.maximum
        return {"type": self.type, "minimum": lo, "maximum": hi}


@dataclass(frozen=True)
class Endpoint:
    name: str
    method: str
    path: str
    summary: str
    request: type[BaseModel] | None = None
    responses: dict[int, type[BaseModel]] = field(default_factory=dict)
    auth: bool = True
    query: dict[str, Query] = field(default_factory=dict)
    #: Error statuses besides those that follow from the row's token, body, path and query
    #: (``errors``).
    more_errors: tuple[int, ...] = ()
    json: bool = True  # False: the response is not JSON (metrics, the dashboard)
    media_type: str = "text/plain"  # what a non-JSON response is
    #: The body may be left out (an empty body is the request's defaults): a field added to a
    #: request older clients sent without a body (the heartbeat's ``condition``).
    body_optional: bool = False
    #: Bytes the body may hold when more than the server's ``max_body_bytes``: a body that
    #: lists the parts of an upload (``protocol.parts.MAX_PARTS_BODY_BYTES``); None: that limit.
    body_limit: int | None = None

    @property
    def errors(self) -> tuple[int, ...]:
        """Every error status this endpoint may answer, in order (the module doc has why)."""
        statuses = set(self.more_errors)
        if self.auth:
            statuses |= AUTH_ERRORS
        if self.request is not None:
            statuses |= BODY_ERRORS
        if ROUND in self.path:
            statuses.add(404)
        if self.query:
            statuses.add(422)
        return tuple(sorted(statuses))

    def url(self, round_: int | None = None) -> str:
        """The path with ``round_`` in place of ``{round}`` (required exactly when it has one)."""
        if (ROUND in self.path) != (round_ is not None):
            raise ValueError(f"{self.name}: round given or missing for {self.path}")
        return self.path if round_ is None else self.path.replace(ROUND, str(int(round_)))


def _upload_step(
    name: str, path: str, summary: str, request: type[BaseModel], response: type[BaseModel]
) -> Endpoint:
    """A step of an upload through the coordinator (grant, completion, commit): a POST whose
    body may list the upload's parts (``body_limit``) and that needs the object store (503)."""
    return Endpoint(
        name,
        "POST",
        path,
        summary,
        request,
        {200: response},
        more_errors=(503,),
        body_limit=MAX_PARTS_BODY_BYTES,
    )


def _upload(
    grant: str,
    complete: str,
    path: str,
    request: type[BaseModel],
    grant_summary: str,
    complete_summary: str,
) -> tuple[Endpoint, Endpoint]:
    """An upload through the coordinator: the grant of presigned PUTs at ``path`` (asked with
    ``request``), then the completion of a multipart one at ``path/complete``; ``grant`` and
    ``complete`` are their names."""
    return (
        _upload_step(grant, path, grant_summary, request, UploadGrant),
        _upload_step(complete, f"{path}/complete", complete_summary, UploadComplete, UploadDone),
    )


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("join", "POST", "/v1/join", "Join the run (or rejoin)", JoinRequest,
             {200: JoinResponse}),
    Endpoint("heartbeat", "POST", "/v1/heartbeat", "Stay an active member, saying what the"
             " node is doing (the body is optional)", HeartbeatRequest,
             {200: RoundView}, body_optional=True),
    Endpoint("leave", "POST", "/v1/leave", "Leave the run", None, {200: Ack}),
    Endpoint("round", "GET", "/v1/round", "The current round as the caller sees it,"
             " long-polling while it waits for members", None, {200: RoundView},
             query={"wait": Query("seconds to wait for a round that waits for members to open"
                                  " (the server waits at most its manifest_wait_max_s)",
                                  "number", 0, 3600)}),
    *_upload("upload", "upload_complete", "/v1/rounds/{round}/upload", UploadRequest,
             "A presigned PUT for the caller's payload of this round, or one per part",
             "Complete the caller's multipart payload upload (write-once: created is false if"
             " the key already held an object)"),
    Endpoint("submit", "POST", "/v1/rounds/{round}/submit",
             "Announce an uploaded payload; idempotent for an identical body. Accepted at once"
             " when it is the payload granted at the key: the round's close then confirms the"
             " object and excludes it as a bad digest if it is not there", SubmitRequest,
             {200: SubmitResponse}, more_errors=(503,)),
    Endpoint("manifest", "GET", "/v1/rounds/{round}/manifest",
             "The signed manifest of a closed round, long-polling while it is open", None,
             {200: ManifestView, 202: RoundView},
             query={"wait": Query("seconds to wait for the round to close (the server waits at"
                                  " most its manifest_wait_max_s)", "number", 0, 3600)}),
    Endpoint("report", "POST", "/v1/rounds/{round}/report",
             "Report the fingerprint after applying a closed round (its participants only);"
             " answers the round as the node now sees it, as GET /v1/round would",
             RoundReport, {200: RoundView}),
    *_upload("checkpoint_upload", "checkpoint_complete", "/v1/checkpoints/{round}/upload",
             CheckpointUpload,
             "A presigned PUT for θ at the start of this round, for the first eligible member",
             "Complete the grant holder's multipart checkpoint upload (write-once)"),
    _upload_step("checkpoint_commit", "/v1/checkpoints/{round}/commit",
                 "Announce the uploaded checkpoint (grant holder only); the coordinator verifies"
                 " the file before it commits it; idempotent", CheckpointUpload, CheckpointInfo),
    Endpoint("checkpoint_latest", "GET", "/v1/checkpoints/latest",
             "The newest committed checkpoint with a presigned GET", None,
             {200: CheckpointView}, more_errors=(404,)),
    Endpoint("checkpoints", "GET", "/v1/checkpoints",
             "Every committed checkpoint still in the store, newest first, with presigned GETs",
             None, {200: CheckpointList}),
    Endpoint("probe", "POST", "/v1/probe",
             "A presigned PUT and GET of a throwaway object, to test the path to the store",
             ProbeRequest, {200: ProbeGrant}, more_errors=(503,)),
    Endpoint("dataset", "GET", "/v1/dataset",
             "The run's prepared dataset: its id and a presigned GET of its manifest", None,
             {200: DatasetView}, more_errors=(404, 503)),
    Endpoint("dataset_files", "POST", "/v1/dataset/files",
             "Presigned GETs for files the run's dataset manifest lists (shards, tokenizer)",
             DatasetFilesRequest, {200: DatasetFiles}, more_errors=(404, 503)),
    Endpoint("status", "GET", "/v1/status", "The run, its members and recent rounds", None,
             {200: StatusView}, auth=False,
             query={"rounds": Query("how many recent rounds to include", "integer", 0,
                                    MAX_STATUS_ROUNDS)}),
    Endpoint("openapi", "GET", "/openapi.json", "This document", None, auth=False),
    Endpoint("metrics", "GET", "/metrics", "Prometheus metrics", None, auth=False, json=False),
    Endpoint("dashboard", "GET", "/", "The live dashboard: one page that polls /v1/status", None,
             auth=False, json=False, media_type="text/html"),
    Endpoint("dashboard_script", "GET", "/dashboard/app.js", "The dashboard's script", None,
             auth=False, json=False, media_type="text/javascript"),
    Endpoint("dashboard_style", "GET", "/dashboard/style.css", "The dashboard's style sheet",
             None, auth=False, json=False, media_type="text/css"),
)  # fmt: skip

#: Endpoints by name.
ROUTES: dict[str, Endpoint] = {ep.name: ep for ep in ENDPOINTS}
