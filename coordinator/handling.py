"""What every route handler shares: bearer auth, body validation, responses and error mapping.

Kept apart from ``coordinator.handlers`` so the handlers read as what they do. Every failure
becomes an ``ErrorBody`` (the classes are ``coordinator.errors``)::

    400 bad_json      body is not JSON             401 unauthorized   no or unknown token
    404 unknown_round / not_found / no_checkpoint  409 round_closed, round_open, not_expected,
    413 too_large     body, payload or checkpoint      not_member, already_submitted, not_needed,
                      too big                          wrong_fingerprint, not_granted, missing
    422 invalid       validation failed (field = dotted location of the first error)
    503 storage_unavailable                        the object store did not answer
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from coordinator.errors import ApiError, RoundError, StorageError, TooLarge, UnknownRound
from protocol.errors import problems
from protocol.messages import ErrorBody

log = logging.getLogger("sparseloco.coordinator.app")

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: token -> node id, for authentication.
TOKENS = web.AppKey("tokens", dict)


def error(status: int, code: str, message: str, field: str | None = None) -> web.Response:
    body = ErrorBody(error=code, message=message, field=field)
    return web.json_response(text=body.model_dump_json(), status=status)


def ok(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(text=model.model_dump_json(), status=status)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return error(exc.status, exc.code, exc.message, exc.field)
    except UnknownRound as exc:
        return error(404, exc.code, exc.message)
    except TooLarge as exc:
        return error(413, exc.code, exc.message, exc.field)
    except RoundError as exc:
        return error(409, exc.code, exc.message)
    except web.HTTPRequestEntityTooLarge as exc:
        return error(413, "too_large", exc.text or "request body too large")
    except StorageError as exc:
        log.warning("event=storage_error path=%s error=%s", request.path, exc)
        return error(503, "storage_unavailable", f"the object store failed: {exc}")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return error(exc.status, code, exc.reason)


def node_of(request: web.Request) -> str:
    """The node id of the request's bearer token; 401 without a known one."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    node_id = request.app[TOKENS].get(token.strip()) if scheme == "Bearer" else None
    if node_id is None:
        raise ApiError(401, "unauthorized", "send Authorization: Bearer <token> from the config")
    return str(node_id)


async def read_body(request: web.Request, model: type[M]) -> M:
    """The body validated as ``model``: 400 if it is not JSON, 422 naming the first bad field."""
    raw = await request.read()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = problems(exc)[0]
        if first.kind == "json_invalid":
            raise ApiError(400, "bad_json", f"the body is not valid JSON: {first.message}") from exc
        loc = first.dotted or None
        raise ApiError(422, "invalid", f"{loc or 'body'}: {first.message}", loc) from exc


def round_of(request: web.Request) -> int:
    return int(request.match_info["round"])


def query_number(request: web.Request, name: str, default: float, hi: float) -> float:
    """Query parameter ``name`` as a number in [0, hi] (422 otherwise), ``default`` if absent."""
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= hi:
        raise ApiError(422, "invalid", f"{name} must be a number in [0, {hi:g}]", name)
    return value
