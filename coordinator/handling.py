"""What every route handler shares: bearer auth, body validation, responses and error mapping.

Kept apart from ``coordinator.handlers`` so the handlers read as what they do. Every failure
becomes an ``ErrorBody`` (the classes are ``coordinator.errors``)::

    400 bad_json      body is not JSON             401 unauthorized   no or unknown token
    404 unknown_round / not_found / no_checkpoint  401 token_revoked  the operator revoked it
    413 too_large     body, payload or checkpoint  409 round_closed, round_open, not_expected,
                      too big                          not_member, already_submitted, not_needed,
    422 invalid       validation failed (field =       wrong_fingerprint, not_granted, missing
                      dotted location of the       409 token_in_use   another process holds this
                      first error)                     node (with a Retry-After header)
    503 storage_unavailable                        the object store did not answer

Authentication (``node_of``) checks the bearer token against the ``TokenBook`` and, when the
request names its process (the ``X-Sparseloco-Instance`` header), that no other live process
holds the node's membership.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from coordinator.errors import (
    ApiError,
    RoundError,
    StorageError,
    TokenInUse,
    TooLarge,
    UnknownRound,
)
from coordinator.service import COORDINATOR
from coordinator.tokens import TokenBook
from protocol.errors import problems
from protocol.messages import INSTANCE_HEADER, INSTANCE_PATTERN, ErrorBody

log = logging.getLogger("sparseloco.coordinator.app")

M = TypeVar("M", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: The node tokens, for authentication.
TOKENS = web.AppKey("tokens", TokenBook)


def error(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = ErrorBody(error=code, message=message, field=field)
    return web.json_response(text=body.model_dump_json(), status=status, headers=headers)


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
    except TokenInUse as exc:
        return error(409, exc.code, exc.message, headers={"Retry-After": str(exc.wait_s)})
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


def node_of(request: web.Request, *, bound: bool = True) -> str:
    """The node id of the request's bearer token (401 without a valid one), once the request's
    process may speak for it (409 ``token_in_use`` while another live process holds it).

    ``bound=False`` leaves the process check to the caller (a join decides it with its body).
    """
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme != "Bearer" or not token.strip():
        raise ApiError(401, "unauthorized", "send Authorization: Bearer <token>")
    node_id = request.app[TOKENS].authenticate(token.strip())
    instance = instance_of(request)
    if bound:
        request.app[COORDINATOR].machine.check_instance(node_id, instance)
    return node_id


def instance_of(request: web.Request) -> str | None:
    """The process id the request carries (``X-Sparseloco-Instance``); 422 if malformed."""
    value = request.headers.get(INSTANCE_HEADER)
    if value is None:
        return None
    if not re.fullmatch(INSTANCE_PATTERN, value):
        raise ApiError(
            422, "invalid", f"{INSTANCE_HEADER} must be 8-64 of A-Z a-z 0-9 _ -", INSTANCE_HEADER
        )
    return value


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
