"""The API's route table and the OpenAPI 3.1 document generated from it.

``ENDPOINTS`` is the one list of routes: ``coordinator.app`` registers a handler for each entry
(by ``name``) and ``openapi_document`` describes each with the pydantic models' JSON schemas, so
the served document cannot drift from the routes or the wire models.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from protocol.messages import (
    Ack,
    CheckpointInfo,
    CheckpointUpload,
    CheckpointView,
    ErrorBody,
    JoinRequest,
    JoinResponse,
    ManifestView,
    RoundReport,
    RoundView,
    StatusView,
    SubmitRequest,
    SubmitResponse,
    UploadGrant,
    UploadRequest,
)


@dataclass(frozen=True)
class Endpoint:
    name: str
    method: str
    path: str
    summary: str
    request: type[BaseModel] | None = None
    responses: dict[int, type[BaseModel]] = field(default_factory=dict)
    auth: bool = True
    query: dict[str, str] = field(default_factory=dict)  # name -> description
    errors: tuple[int, ...] = ()
    json: bool = True  # False: the response is not JSON (metrics)


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("join", "POST", "/v1/join", "Join the run (or rejoin)", JoinRequest,
             {200: JoinResponse}, errors=(400, 401, 413, 422)),
    Endpoint("heartbeat", "POST", "/v1/heartbeat", "Stay an active member", None,
             {200: RoundView}, errors=(401, 409)),
    Endpoint("leave", "POST", "/v1/leave", "Leave the run", None, {200: Ack}, errors=(401, 409)),
    Endpoint("round", "GET", "/v1/round", "The current round as the caller sees it", None,
             {200: RoundView}, errors=(401,)),
    Endpoint("upload", "POST", "/v1/rounds/{round}/upload",
             "A presigned PUT for the caller's payload of this round", UploadRequest,
             {200: UploadGrant}, errors=(400, 401, 404, 409, 413, 422)),
    Endpoint("submit", "POST", "/v1/rounds/{round}/submit",
             "Announce an uploaded payload; idempotent for an identical body", SubmitRequest,
             {200: SubmitResponse}, errors=(400, 401, 404, 409, 413, 422)),
    Endpoint("manifest", "GET", "/v1/rounds/{round}/manifest",
             "The signed manifest of a closed round, long-polling while it is open", None,
             {200: ManifestView, 202: RoundView},
             query={"wait": "seconds to wait for the round to close (capped by the server)"},
             errors=(401, 404, 422)),
    Endpoint("report", "POST", "/v1/rounds/{round}/report",
             "Report the fingerprint after applying a closed round", RoundReport, {200: Ack},
             errors=(400, 401, 404, 409, 413, 422)),
    Endpoint("checkpoint_upload", "POST", "/v1/checkpoints/{round}/upload",
             "A presigned PUT for θ at the start of this round, for the first eligible node",
             CheckpointUpload, {200: UploadGrant}, errors=(400, 401, 404, 409, 413, 422)),
    Endpoint("checkpoint_commit", "POST", "/v1/checkpoints/{round}/commit",
             "Announce the uploaded checkpoint (grant holder only); idempotent", CheckpointUpload,
             {200: CheckpointInfo}, errors=(400, 401, 409, 413, 422, 503)),
    Endpoint("checkpoint_latest", "GET", "/v1/checkpoints/latest",
             "The newest committed checkpoint with a presigned GET", None,
             {200: CheckpointView}, errors=(401, 404)),
    Endpoint("status", "GET", "/v1/status", "The run, its members and recent rounds", None,
             {200: StatusView}, auth=False,
             query={"rounds": "how many recent rounds to include"}, errors=(422,)),
    Endpoint("openapi", "GET", "/openapi.json", "This document", None, auth=False),
    Endpoint("metrics", "GET", "/metrics", "Prometheus metrics", None, auth=False, json=False),
)  # fmt: skip

_ERROR_TEXT = {
    400: "the body is not JSON",
    401: "missing or unknown bearer token",
    404: "unknown round, or no checkpoint yet",
    409: "conflicts with the round, membership or checkpoint state",
    413: "body, payload or checkpoint too large",
    422: "the body failed validation",
    503: "the object store did not answer",
}


def _models() -> list[type[BaseModel]]:
    seen: dict[str, type[BaseModel]] = {"ErrorBody": ErrorBody}
    for ep in ENDPOINTS:
        for model in [ep.request, *ep.responses.values()]:
            if model is not None:
                seen[model.__name__] = model
    return list(seen.values())


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def openapi_document(version: str = "1") -> dict[str, Any]:
    """The OpenAPI 3.1 description of every route in ``ENDPOINTS``."""
    _, defs = models_json_schema(
        [(m, "validation") for m in _models()], ref_template="#/components/schemas/{model}"
    )
    paths: dict[str, dict[str, Any]] = {}
    for ep in ENDPOINTS:
        op: dict[str, Any] = {"operationId": ep.name, "summary": ep.summary, "responses": {}}
        params: list[dict[str, Any]] = []
        if "{round}" in ep.path:
            params.append(
                {"name": "round", "in": "path", "required": True,
                 "schema": {"type": "integer", "minimum": 0}}
            )  # fmt: skip
        for name, text in ep.query.items():
            params.append(
                {"name": name, "in": "query", "required": False, "description": text,
                 "schema": {"type": "number", "minimum": 0}}
            )  # fmt: skip
        if params:
            op["parameters"] = params
        if ep.request is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _ref(ep.request)}},
            }
        if ep.auth:
            op["security"] = [{"bearer": []}]
        for status, model in ep.responses.items():
            op["responses"][str(status)] = {
                "description": model.__doc__.strip().splitlines()[0] if model.__doc__ else "OK",
                "content": {"application/json": {"schema": _ref(model)}},
            }
        if not ep.responses:
            kind = "application/json" if ep.json else "text/plain"
            op["responses"]["200"] = {"description": "OK", "content": {kind: {}}}
        for status in ep.errors:
            op["responses"][str(status)] = {
                "description": _ERROR_TEXT[status],
                "content": {"application/json": {"schema": _ref(ErrorBody)}},
            }
        paths.setdefault(ep.path, {})[ep.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "sparseloco coordinator", "version": version},
        "paths": paths,
        "components": {
            "schemas": defs["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
