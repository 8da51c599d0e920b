"""One simulated node of ``sparseloco bench coordinator``: a node daemon over HTTP, minus compute.

Each does what a node daemon does over the coordinator's API: join; heartbeat at the interval
the join answered; ask for the round (long-polling while it waits for members, as
``node.daemon.client`` does, or every 0.25 s against a coordinator without the round long-poll);
"train" (a sleep of ``train_s`` plus up to ``spread_s``); ask for an upload grant; PUT a small
payload of the announced size and sha256 to the presigned URL; submit; long-poll the signed
manifest; "download and apply" it (a sleep of ``apply_s`` times 0.5 to 1.5; 0 makes every node
report in the same instant, a worst case no real fleet produces); report a fingerprint, whose
answer is the next round's view. The payload is random bytes: the coordinator never decodes
one. As the node daemon does, every request says what the node is doing
(``X-Sparseloco-Condition``) and a heartbeat goes out only into a silence: an interval after the
last answer the coordinator counted as one (``X-Sparseloco-Heard``), or ``GAP_S`` after a change
of condition no request has said. Every node of a run shares one ``Recorder``: latencies per
request type, errors, and when each round's last submit went out and each manifest arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from node.daemon.condition import GAP_S
from protocol.messages import (
    CONDITION_HEADER,
    HEARD_HEADER,
    INSTANCE_HEADER,
    NodeCondition,
    RoundState,
)
from protocol.routes import ROUTES

#: What a node daemon asks the manifest long-poll to wait (``ClientTimeouts.manifest_wait_s``).
MANIFEST_WAIT_S = 20.0
#: The round long-poll asked for while a round waits for members (``round_wait_s``).
ROUND_WAIT_S = 2.5
#: The node's pause between polls of a waiting round without the long-poll (``loop.py``).
WAITING_POLL_S = 0.25
REQUEST_TIMEOUT_S = 60.0
#: Upload attempts (grant and PUT) before a simulated node gives its round up.
PUT_ATTEMPTS = 5


def fingerprint(round_: int) -> str:
    """The fake θ fingerprint every simulated node holds at the start of ``round_``."""
    return hashlib.sha256(f"theta-{round_}".encode()).hexdigest()[:32]


@dataclass
class Recorder:
    """Latencies per request type, errors, and per-round submit and manifest times."""

    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    last_submit_sent: dict[int, float] = field(default_factory=dict)
    manifest_at: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    round_long_poll: bool = True

    def error(self, what: str) -> None:
        self.errors[what] += 1

    def summary(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for name, values in sorted(self.latency.items()):
            ordered = sorted(values)
            if not ordered:  # e.g. a probe that got no answer it could time
                out[name] = {"n": 0}
                continue
            out[name] = {
                "n": len(ordered),
                "p50_ms": 1000 * ordered[len(ordered) // 2],
                "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
                "max_ms": 1000 * ordered[-1],
            }
        return out


class SimNode:
    """One simulated node: its token, its HTTP calls, its round loop and its heartbeat."""

    def __init__(
        self, name: str, token: str, url: str, session: aiohttp.ClientSession, rec: Recorder
    ) -> None:
        self.name = name
        self.url = url
        self.session = session
        self.rec = rec
        self.headers = {"Authorization": f"Bearer {token}", INSTANCE_HEADER: secrets.token_hex(8)}
        self.interval = 7.5
        #: What the node is doing, and whether it changed since the heartbeat last looked.
        self.condition = NodeCondition.TRAINING
        self.changed = asyncio.Event()
        #: The condition the coordinator holds for the node (the latest request said it, or
        #: the last answer counted as a heartbeat named it), and when that answer came.
        self.said: NodeCondition | None = None
        self.heard_at: float | None = None
        #: The view the last report was answered with.
        self.reported: dict[str, Any] | None = None

    async def call(
        self, name: str, body: Any = None, *, round_: int | None = None, wait: float = 0.0
    ) -> tuple[int, Any]:
        """One request of endpoint ``name``; its status and parsed body (``None`` on error)."""
        ep = ROUTES[name]
        params = {"wait": f"{wait:g}"} if wait else None
        data = None if body is None else json.dumps(body).encode()
        said = self.said = self.condition
        headers = {**self.headers, CONDITION_HEADER: said.value}
        if data is not None:
            headers["Content-Type"] = "application/json"
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S + wait)
        start = time.monotonic()
        try:
            async with self.session.request(
                ep.method, self.url + ep.url(round_), data=data, headers=headers,
                params=params, timeout=timeout,
            ) as resp:  # fmt: skip
                raw = await resp.read()
                status = resp.status
                held = resp.headers.get(HEARD_HEADER)
                if status < 400 and held is not None:
                    self.heard_at = time.monotonic()
                    self.said = NodeCondition(held)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.rec.error(f"{name}:{type(exc).__name__}:{getattr(exc, 'errno', None)}")
            return 0, None
        took = time.monotonic() - start
        parsed = json.loads(raw) if raw else None
        if status >= 400:
            code = parsed.get("error") if isinstance(parsed, dict) else status
            self.rec.error(f"{name}:{status}:{code}")
            return status, parsed
        # A long-poll's time is mostly its wait: kept apart, and only when it was answered.
        if not (wait and status == 202):
            self.rec.latency[f"{name}_long_poll" if wait else name].append(took)
        return status, parsed

    async def join(self) -> bool:
        body = {"client": "bench", "instance": self.headers[INSTANCE_HEADER]}
        status, joined = await self.call("join", body)
        if status == 200:
            self.interval = float(joined["heartbeat_interval_s"])
        return status == 200

    def say(self, condition: NodeCondition) -> None:
        if condition != self.condition:
            self.condition = condition
            self.changed.set()

    async def heartbeat(self) -> None:
        """Beat into silences as the node daemon does (``node.daemon.loop``, ``condition``):
        an interval after the last answer counted as one, and ``GAP_S`` after a change of
        condition that no request has said."""
        wait = random.uniform(0, self.interval)
        while True:
            await asyncio.sleep(min(wait, GAP_S))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), max(0.0, wait - GAP_S))
            self.changed.clear()
            age = time.monotonic() - self.heard_at if self.heard_at else self.interval
            if self.said == self.condition and age < self.interval:
                wait = self.interval - age
                continue
            wait = self.interval
            status, body = await self.call("heartbeat")
            if status == 409 and isinstance(body, dict) and body.get("error") == "not_member":
                await self.join()  # timed out: a node daemon joins again

    async def wait_open(self, r: int) -> dict[str, Any]:
        """The round view once round ``r`` is open (polling as a node daemon does)."""
        waiting = False
        while True:
            wait = ROUND_WAIT_S if waiting and self.rec.round_long_poll else 0.0
            if self.reported is not None:  # the report's answer, as the node's client takes it
                status, view, self.reported = 200, self.reported, None
            else:
                status, view = await self.call("round", wait=wait)
            waiting = status == 200 and view["state"] == RoundState.WAITING
            if status == 422 and wait and isinstance(view, dict) and view.get("field") == "wait":
                self.rec.round_long_poll = False  # an older coordinator: poll instead
                self.rec.errors.pop("round:422:invalid", None)
                continue
            if status == 200 and view["round"] >= r and view["state"] != RoundState.WAITING:
                return dict(view)
            await asyncio.sleep(WAITING_POLL_S if status == 200 else 1.0)

    async def run(
        self, rounds: int, train_s: float, spread_s: float, size: int, apply_s: float
    ) -> None:
        if not await self.join():
            return
        beat = asyncio.create_task(self.heartbeat())
        try:
            for r in range(rounds):
                view = await self.wait_open(r)
                if view["round"] != r or not view["expected"]:
                    self.rec.error(f"round:not_expected_in_{r}")
                    continue
                await asyncio.sleep(train_s + random.uniform(0, spread_s))
                await self.contribute(r, size, apply_s)
        finally:
            beat.cancel()

    async def put(self, grant: dict[str, Any], payload: bytes) -> bool:
        """Upload ``payload`` to the presigned URL of ``grant``; whether it was stored."""
        start = time.monotonic()
        try:
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            async with self.session.put(
                grant["url"], data=payload, headers=grant["headers"], timeout=timeout
            ) as resp:
                await resp.read()
                if resp.status >= 300:
                    self.rec.error(f"put:{resp.status}")
                    return False
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.rec.error(f"put:{type(exc).__name__}:{getattr(exc, 'errno', None)}")
            return False
        self.rec.latency["put"].append(time.monotonic() - start)
        return True

    async def contribute(self, r: int, size: int, apply_s: float) -> None:
        payload = os.urandom(size)
        sha = hashlib.sha256(payload).hexdigest()
        for attempt in range(PUT_ATTEMPTS):  # a failed upload is tried again, as a node does
            if attempt:
                await asyncio.sleep(1.0)
            status, grant = await self.call("upload", {"size": size, "sha256": sha}, round_=r)
            if status == 200 and await self.put(grant, payload):
                break
        else:
            return
        sent = time.monotonic()
        body = {"size": size, "sha256": sha, "base_fingerprint": fingerprint(r)}
        status, _ = await self.call("submit", body, round_=r)
        self.rec.last_submit_sent[r] = max(self.rec.last_submit_sent.get(r, 0.0), sent)
        if status != 200:
            return
        self.say(NodeCondition.WAITING)
        try:
            while True:
                status, view = await self.call("manifest", round_=r, wait=MANIFEST_WAIT_S)
                if status == 200:
                    break
                if status != 202:
                    return
        finally:
            self.say(NodeCondition.TRAINING)
        self.rec.manifest_at[r].append(time.monotonic())
        if len(view["urls"]) != len(view["signed"]["manifest"]["gather"]):
            self.rec.error("manifest:urls")
        await asyncio.sleep(apply_s * random.uniform(0.5, 1.5))
        status, view = await self.call("report", {"fingerprint": fingerprint(r + 1)}, round_=r)
        if status == 200 and isinstance(view, dict) and "state" in view:
            self.reported = view
