"""The OpenAPI 3.1 document of the coordinator's API, generated from ``protocol.routes``.

Each entry of the route table is described with the pydantic models' JSON schemas, so the
served document cannot drift from the routes the coordinator registers, the paths the node's
client calls, or the wire models. Query parameters carry their declared type and range, the
round in a path its range, authenticated operations the optional ``X-Sparseloco-Instance``
header; every error status an operation may answer is listed with ``ErrorBody``. The API fuzz
test (``tests/test_api_fuzz.py``) holds the coordinator to this document.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from protocol.messages import INSTANCE_HEADER, INSTANCE_PATTERN, ErrorBody
from protocol.routes import ENDPOINTS, MAX_ROUND, ROUND

_ERROR_TEXT = {
    400: "the body is empty or not JSON",
    401: "missing, unknown or revoked bearer token",
    404: "unknown round (or not a round number), or no checkpoint yet",
    408: "the body did not arrive in time",
    409: "conflicts with the round, membership or checkpoint state",
    413: "body, payload or checkpoint too large",
    422: "the body, a query parameter or the instance header failed validation",
    429: "rate limited: too many failed authentications from this address, or requests from"
    " this node",
    503: "the object store did not answer",
}
#: Error statuses that come with a ``Retry-After`` header (seconds).
_RETRY_AFTER = {409, 429}


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
        if ROUND in ep.path:
            params.append(
                {"name": "round", "in": "path", "required": True,
                 "schema": {"type": "integer", "minimum": 0, "maximum": MAX_ROUND}}
            )  # fmt: skip
        for name, spec in ep.query.items():
            params.append(
                {"name": name, "in": "query", "required": False,
                 "description": spec.description, "schema": spec.schema()}
            )  # fmt: skip
        if ep.auth:
            params.append(
                {"name": INSTANCE_HEADER, "in": "header", "required": False,
                 "description": "random id of the calling process: a member is bound to the"
                 " process that joined it",
                 "schema": {"type": "string", "pattern": INSTANCE_PATTERN}}
            )  # fmt: skip
        if params:
            op["parameters"] = params
        if ep.request is not None:
            op["requestBody"] = {
                "required": not ep.body_optional,
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
            kind = "application/json" if ep.json else ep.media_type
            op["responses"]["200"] = {"description": "OK", "content": {kind: {}}}
        for status in ep.errors:
            op["responses"][str(status)] = {
                "description": _ERROR_TEXT[status],
                "content": {"application/json": {"schema": _ref(ErrorBody)}},
            }
            if status in _RETRY_AFTER:
                op["responses"][str(status)]["headers"] = {
                    "Retry-After": {
                        "description": "seconds to wait (token_in_use, rate_limited)",
                        "schema": {"type": "string", "pattern": "^[0-9]+$"},
                    }
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
