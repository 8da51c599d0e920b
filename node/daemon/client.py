"""The coordinator client: typed calls for every endpoint of ``protocol.messages``.

Each call validates its response with the shared pydantic models and retries transient failures
(connection refused while the coordinator restarts, 5xx, timeouts) with backoff inside a time
budget. A refusal the coordinator means (401, 404, 409, 422) raises ``CoordinatorError`` at once
with the coordinator's error code, so the round loop can act on it (``round_closed`` means the
node missed the round and keeps its contribution).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from node.daemon.retry import TRANSIENT_STATUS, RetryPolicy, retry
from node.errors import CoordinatorError, TransientError
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

log = logging.getLogger("sparseloco.client")

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class ClientTimeouts:
    """Per-request limits, named by phase."""

    connect_s: float = 10.0
    request_s: float = 30.0
    #: Longest server-side wait asked for on the manifest long-poll.
    manifest_wait_s: float = 20.0


class CoordinatorClient:
    """Calls the coordinator at ``base_url`` as the node holding ``token``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        token: str,
        *,
        timeouts: ClientTimeouts | None = None,
        policy: RetryPolicy | None = None,
    ) -> None:
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"}
        self.timeouts = timeouts or ClientTimeouts()
        self.policy = policy or RetryPolicy(attempts=40, max_delay_s=5.0, budget_s=180.0)

    async def _call(
        self,
        method: str,
        path: str,
        model: type[M],
        body: BaseModel | None = None,
        *,
        params: dict[str, str] | None = None,
        extra_wait_s: float = 0.0,
        accept_202: type[BaseModel] | None = None,
    ) -> BaseModel:
        timeout = aiohttp.ClientTimeout(
            total=self.timeouts.request_s + extra_wait_s, sock_connect=self.timeouts.connect_s
        )
        data = body.model_dump_json().encode() if body is not None else None
        headers = dict(self.headers)
        if data is not None:
            headers["Content-Type"] = "application/json"

        async def attempt() -> BaseModel:
            async with self.session.request(
                method,
                self.base_url + path,
                data=data,
                headers=headers,
                params=params,
                timeout=timeout,
            ) as resp:
                raw = await resp.read()
                if resp.status in TRANSIENT_STATUS:
                    raise TransientError(f"{method} {path}: HTTP {resp.status}")
                if resp.status >= 400:
                    try:
                        err = ErrorBody.model_validate_json(raw)
                        raise CoordinatorError(resp.status, err.error, err.message)
                    except ValidationError:
                        raise CoordinatorError(
                            resp.status, "http", raw[:200].decode("utf-8", "replace")
                        ) from None
                target: type[BaseModel] = model
                if resp.status == 202 and accept_202 is not None:
                    target = accept_202
                try:
                    return target.model_validate_json(raw)
                except ValidationError as exc:
                    raise CoordinatorError(
                        resp.status, "bad_response", f"{method} {path}: {exc}"
                    ) from exc

        return await retry(attempt, policy=self.policy, what=f"{method} {path}")

    async def join(self, client: str = "") -> JoinResponse:
        out = await self._call("POST", "/v1/join", JoinResponse, JoinRequest(client=client))
        return JoinResponse.model_validate(out)

    async def heartbeat(self) -> RoundView:
        return RoundView.model_validate(await self._call("POST", "/v1/heartbeat", RoundView))

    async def leave(self) -> None:
        await self._call("POST", "/v1/leave", Ack)

    async def round(self) -> RoundView:
        return RoundView.model_validate(await self._call("GET", "/v1/round", RoundView))

    async def upload_grant(self, round_: int, size: int, sha256: str) -> UploadGrant:
        out = await self._call(
            "POST",
            f"/v1/rounds/{round_}/upload",
            UploadGrant,
            UploadRequest(size=size, sha256=sha256),
        )
        return UploadGrant.model_validate(out)

    async def submit(self, round_: int, request: SubmitRequest) -> SubmitResponse:
        out = await self._call("POST", f"/v1/rounds/{round_}/submit", SubmitResponse, request)
        return SubmitResponse.model_validate(out)

    async def manifest(self, round_: int) -> ManifestView | RoundView:
        """The closed round's manifest, or the round's view if it is still open after a wait."""
        wait = self.timeouts.manifest_wait_s
        out = await self._call(
            "GET",
            f"/v1/rounds/{round_}/manifest",
            ManifestView,
            params={"wait": f"{wait:g}"},
            extra_wait_s=wait,
            accept_202=RoundView,
        )
        if isinstance(out, ManifestView | RoundView):
            return out
        raise TypeError(f"unexpected response type {type(out).__name__}")

    async def report(self, round_: int, report: RoundReport) -> None:
        await self._call("POST", f"/v1/rounds/{round_}/report", Ack, report)

    async def checkpoint_grant(self, round_: int, offer: CheckpointUpload) -> UploadGrant:
        """A presigned PUT for θ_round as a checkpoint; ``CoordinatorError`` ``not_needed``."""
        out = await self._call("POST", f"/v1/checkpoints/{round_}/upload", UploadGrant, offer)
        return UploadGrant.model_validate(out)

    async def checkpoint_commit(self, round_: int, offer: CheckpointUpload) -> CheckpointInfo:
        out = await self._call("POST", f"/v1/checkpoints/{round_}/commit", CheckpointInfo, offer)
        return CheckpointInfo.model_validate(out)

    async def latest_checkpoint(self) -> CheckpointView | None:
        """The newest accepted checkpoint with a presigned GET, or None if there is none."""
        try:
            out = await self._call("GET", "/v1/checkpoints/latest", CheckpointView)
        except CoordinatorError as exc:
            if exc.status == 404:  # no_checkpoint (or a coordinator without checkpoints)
                return None
            raise
        return CheckpointView.model_validate(out)

    async def status(self, rounds: int | None = None) -> StatusView:
        params = {"rounds": str(rounds)} if rounds is not None else None
        out = await self._call("GET", "/v1/status", StatusView, params=params)
        return StatusView.model_validate(out)
