"""What every route handler shares: bearer auth, body validation, responses and error mapping.

Kept apart from ``coordinator.api.handlers`` so the handlers read as what they do. Every failure
becomes an ``ErrorBody`` (the classes are ``coordinator.base.errors``)::

    400 bad_json      body is not JSON (or empty)  401 unauthorized   no or unknown token
    404 unknown_round / not_found / no_checkpoint  401 token_revoked  the operator revoked it
    408 timeout       the body did not arrive in   409 round_closed, round_open, not_expected,
                      time (limits.body_timeout_s)     not_member, already_submitted, not_needed,
    413 too_large     body, payload or checkpoint      wrong_fingerprint, not_granted, missing,
                      too big                          bad_checkpoint
    422 invalid       validation failed (field =   409 token_in_use   another process holds this
                      dotted location of the           node (with a Retry-After header)
                      first error)                 429 rate_limited   too many failed
    503 storage_unavailable                            authentications from the address, or
                      the object store did not         requests from the node (Retry-After)
                      answer

Authentication (``node_of``) first refuses an address out of failed attempts, then checks the
bearer token against the ``TokenBook`` (a failure spends the address's allowance), counts the
request against the node's rate, and, when the request names its process (the
``X-Sparseloco-Instance`` header), checks that no other live process holds the node's
membership (``coordinator.base.limits`` has the rates).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from coordinator.api.service import COORDINATOR, Coordinator
from coordinator.base.errors import (
    ApiError,
    RateLimited,
    RoundError,
    StorageError,
    TokenInUse,
    TooLarge,
    UnknownRound,
)
from coordinator.base.limits import LIMITS
from coordinator.rules.tokens import TokenBook
from protocol.errors import problems
from protocol.messages import (
    CONDITION_HEADER,
    HEARD_HEADER,
    INSTANCE_HEADER,
    INSTANCE_PATTERN,
    ErrorBody,
    NodeCondition,
)
from protocol.routes import ROUTES, Endpoint, Query

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
    except RateLimited as exc:
        return error(429, exc.code, exc.message, headers={"Retry-After": str(exc.wait_s)})
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
        # An outage was logged once by the store's link; a refusal is worth a line each time.
        log.log(
            logging.DEBUG if exc.unreachable else logging.WARNING,
            "event=storage_error path=%s cause=%r",
            request.path,
            str(exc)[:160],
        )
        return error(503, "storage_unavailable", f"the object store failed: {exc}")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "http_error")
        return error(exc.status, code, exc.reason)


#: Endpoints that write nothing to the database (a heartbeat is a dictionary write, an upload
#: grant a signature): their answers never wait for the disk, so they never queue behind a
#: burst of commits. What they show may be committed and not yet synced; a node acts on its
#: own requests' answers, which do wait, and a machine crash in those milliseconds looks to it
#: like a coordinator restart.
READ_ONLY = frozenset(
    {"heartbeat", "round", "upload", "status", "openapi", "metrics", "checkpoint_latest"}
    | {"checkpoints", "dashboard", "dashboard_script", "dashboard_style"}
)


#: Endpoints that write, but whose loss in a machine crash the node repairs by itself, so
#: their answers do not wait for the disk either: a submission the coordinator does not hold
#: when its round is still open shows in the round view the node's manifest long-poll gets
#: (``submitted`` false), and the node sends it again (``event=resubmit``,
#: ``node.daemon.rounds``). At 1,000 nodes beside a CPU-bound process the wait for the group
#: fsync was most of a submit's time (docs/benchmarks.md §11).
SELF_REPAIRED = frozenset({"submit"})
_NO_WAIT = READ_ONLY | SELF_REPAIRED


@web.middleware
async def durable_answers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """No answer leaves before the state it reflects is on disk (``Coordinator.durable``):
    outermost, so error answers wait too; ``READ_ONLY`` and ``SELF_REPAIRED`` endpoints
    excepted."""
    if request.match_info.route.name in _NO_WAIT:
        return await handler(request)
    coord = request.app[COORDINATOR]
    try:
        response = await handler(request)
    except Exception:
        await coord.durable()
        raise
    await coord.durable()
    return response


def node_of(request: web.Request, *, bound: bool = True) -> str:
    """The node id of the request's bearer token (401 without a valid one), once the request's
    process may speak for it (409 ``token_in_use`` while another live process holds it).

    ``bound=False`` leaves the process check to the caller (a join decides it with its body).
    """
    limits = request.app[LIMITS]
    address = request.remote or "-"
    limits.before_auth(address)
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    try:
        if scheme != "Bearer" or not token.strip():
            raise ApiError(401, "unauthorized", "send Authorization: Bearer <token>")
        node_id = request.app[TOKENS].authenticate(token.strip())
    except ApiError:
        limits.auth_failed(address)
        raise
    limits.node_request(node_id)
    instance = instance_of(request)
    if bound:
        machine = request.app[COORDINATOR].machine
        machine.check_instance(node_id, instance)
        said = condition_of(request)
        if said is not None and machine.heard(node_id, said):
            request[HEARD] = said
    return node_id


#: Request key: the condition the request said, if it counted as the node's heartbeat
#: (``add_heard``).
HEARD = web.RequestKey("sparseloco_heard", NodeCondition)


def heard_again(request: web.Request, node_id: str, condition: NodeCondition) -> None:
    """The answer changes what the coordinator holds the node to be doing (a manifest handed
    out: ``training``); only for a request that counted as a heartbeat."""
    if request.get(HEARD) is not None:
        request.app[COORDINATOR].machine.heard(node_id, condition)
        request[HEARD] = condition


def condition_of(request: web.Request) -> NodeCondition | None:
    """What the request says the node is doing (``X-Sparseloco-Condition``); 422 if malformed."""
    value = request.headers.get(CONDITION_HEADER)
    if value is None:
        return None
    try:
        return NodeCondition(value)
    except ValueError:
        allowed = ", ".join(c.value for c in NodeCondition)
        raise ApiError(
            422, "invalid", f"{CONDITION_HEADER} must be one of {allowed}", CONDITION_HEADER
        ) from None


async def add_heard(request: web.Request, response: web.StreamResponse) -> None:
    """(``on_response_prepare``) Tell the node its request counted as a heartbeat, and the
    condition the coordinator now holds for it."""
    said = request.get(HEARD)
    if said is not None:
        response.headers[HEARD_HEADER] = said.value


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


async def read_body(request: web.Request, model: type[M], *, optional: bool = False) -> M:
    """The body validated as ``model``: 400 if it is empty or not JSON, 408 if it does not arrive
    within ``limits.body_timeout_s``, 422 naming the first bad field. ``optional``: an empty
    body is ``model``'s defaults (an endpoint older clients called without one)."""
    timeout = request.app[LIMITS].config.body_timeout_s
    route = request.match_info.route.name
    limit = ROUTES[route].body_limit if route in ROUTES else None
    if limit is not None and limit > request.client_max_size:
        request = request.clone(client_max_size=limit)  # a body that lists parts
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise ApiError(408, "timeout", f"the body did not arrive within {timeout:g} s") from None
    if not raw.strip():
        if optional:
            return model()
        raise ApiError(400, "bad_json", "the body is empty; send a JSON object ({} at least)")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = problems(exc)[0]
        if first.kind == "json_invalid":
            raise ApiError(400, "bad_json", f"the body is not valid JSON: {first.message}") from exc
        loc = first.dotted or None
        raise ApiError(422, "invalid", f"{loc or 'body'}: {first.message}", loc) from exc


def known_query(endpoint: Endpoint, handler: Handler) -> Handler:
    """``handler`` behind a check that the request names only the query parameters
    ``endpoint`` declares: 422 naming the first other one (a typo is not ignored in silence)."""

    async def checked(request: web.Request) -> web.StreamResponse:
        unknown = sorted(set(request.query) - set(endpoint.query))
        if unknown:
            name = unknown[0][:64]
            known = ", ".join(endpoint.query) or "none"
            raise ApiError(
                422, "invalid", f"unknown query parameter {name!r} (known: {known})", name
            )
        return await handler(request)

    return checked


def round_of(request: web.Request) -> int:
    return int(request.match_info["round"])


#: What a query value of each declared type may look like (JSON's number syntax, no sign).
_QUERY_SYNTAX = {
    "integer": re.compile(r"(0|[1-9][0-9]{0,17})"),
    "number": re.compile(r"(0|[1-9][0-9]{0,17})(\.[0-9]{1,17})?([eE][+-]?[0-9]{1,3})?"),
}


def query_value(request: web.Request, name: str, spec: Query, default: float) -> float:
    """Query parameter ``name`` as its route declares it (``spec``: type and range), ``default``
    if absent; 422 naming the parameter for anything else (nothing is clamped in silence)."""
    raw = request.query.get(name)
    if raw is None:
        return default
    value = float(raw) if _QUERY_SYNTAX[spec.type].fullmatch(raw) else math.nan
    if not spec.minimum <= value <= spec.maximum:
        raise ApiError(
            422, "invalid", f"{name} must be {spec.type} in [{spec.minimum:g}, {spec.maximum:g}]",
            name,
        )  # fmt: skip
    return value


async def round_request(request: web.Request, model: type[M]) -> tuple[Coordinator, str, int, M]:
    """What a node's request about one round carries, checked in this order: the caller
    (``node_of``), the round in the path, the body validated as ``model``; with the service."""
    coord = request.app[COORDINATOR]
    node_id = node_of(request)
    return coord, node_id, round_of(request), await read_body(request, model)
