"""``sparseloco bench coordinator``: the real coordinator under N simulated nodes.

It starts the embedded SeaweedFS store and ``python -m coordinator`` (a process of its own, with
N tokens seeded from ``[tokens]``), then runs N simulated nodes in this one asyncio process. Each
does what a node daemon does over the HTTP API, minus the compute: join; heartbeat at the
interval the join answered; ask for the round (long-polling while it waits for members, as
``node.daemon.client`` does, or every 0.25 s against a coordinator without the round long-poll);
"train" (a sleep of ``train_s`` plus up to ``spread_s``); ask for an upload grant; PUT a small
payload of the announced size and sha256 to the presigned URL; submit; long-poll the signed
manifest; "download and apply" it (a sleep of ``apply_s`` times 0.5 to 1.5; 0 makes every node
report in the same instant, a worst case no real fleet produces); report a fingerprint, whose
answer is the next round's view. The payload is random bytes: the coordinator never decodes
one. As the node daemon does, every request says what the node is doing
(``X-Sparseloco-Condition``) and a heartbeat goes out only into a silence: an interval after the
last answer the coordinator counted as one (``X-Sparseloco-Heard``), or ``GAP_S`` after a change
of condition no request has said.

Measured: latency per request type (p50, p99, max), every error, "last submit to manifest
on every node" per round (from when the last submit was sent to when the last node held the
manifest), the coordinator's CPU share over the rounds (from ``/proc``, 100 % = one core), this
process's CPU and event-loop lag (so a saturated client shows), and how many members the
coordinator timed out. Once every node has started, this process's objects are frozen out of
its garbage collector (see ``drive``). Targets (issue 11, benchmark 4): heartbeat p99 < 100 ms,
submit p99 < 250 ms, manifest everywhere < 2 s after the last submit, zero errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import random
import secrets
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from node.cluster.launch import coordinator_toml, start_coordinator
from node.cluster.seaweed import EmbeddedStore
from node.cluster.status import fetch_status
from node.daemon.condition import GAP_S
from protocol.messages import (
    CONDITION_HEADER,
    HEARD_HEADER,
    INSTANCE_HEADER,
    MemberState,
    NodeCondition,
    RoundState,
)
from protocol.routes import ROUTES
from protocol.runconfig import RunConfig, Timing

log = logging.getLogger("sparseloco.bench.coordinator")

TARGETS = {"heartbeat_p99_ms": 100.0, "submit_p99_ms": 250.0, "manifest_all_s": 2.0}
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
        out = {}
        for name, values in sorted(self.latency.items()):
            ordered = sorted(values)
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


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pressure() -> str:
    """The kernel's CPU pressure line (how often runnable work waited for a core), if any:
    other work on the machine shows here."""
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return "-"


async def _loop_lag(samples: list[float]) -> None:
    """How late this process's event loop wakes up (a saturated client inflates latencies)."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(0.1)
        samples.append(time.monotonic() - start - 0.1)


async def drive(
    url: str, tokens: dict[str, str], rounds: int, train_s: float, spread_s: float,
    size: int, apply_s: float, join_s: float, timeout_s: float, coordinator_pid: int,
) -> dict[str, Any]:  # fmt: skip
    """Run every simulated node through ``rounds`` rounds; the measurements."""
    rec = Recorder()
    lag: list[float] = []
    lag_task = asyncio.create_task(_loop_lag(lag))
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        nodes = [SimNode(n, t, url, session, rec) for n, t in tokens.items()]
        start, cpu0, own0 = time.monotonic(), _cpu_s(coordinator_pid), _cpu_s(os.getpid())
        tasks = []
        for i, node in enumerate(nodes):
            tasks.append(asyncio.create_task(node.run(rounds, train_s, spread_s, size, apply_s)))
            await asyncio.sleep(join_s / len(nodes) if i < len(nodes) - 1 else 0)
        # N nodes in one process: a full collection of them all would stall this loop for
        # ~0.1 s and count as the coordinator's latency (real nodes are processes of their own).
        gc.freeze()
        _, unfinished = await asyncio.wait(tasks, timeout=timeout_s)
        for task in unfinished:
            task.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
        wall = time.monotonic() - start
        cpu, own = _cpu_s(coordinator_pid) - cpu0, _cpu_s(os.getpid()) - own0
    lag_task.cancel()
    gc.unfreeze()
    per_round = []
    for r in range(rounds):
        got = rec.manifest_at.get(r, [])
        last_sent = rec.last_submit_sent.get(r)
        per_round.append({
            "round": r,
            "manifests": len(got),
            "last_submit_to_all_manifests_s": max(got) - last_sent if got and last_sent else None,
        })  # fmt: skip
    lag.sort()
    return {
        "latency": rec.summary(),
        "errors": dict(rec.errors),
        "rounds": per_round,
        "wall_s": wall,
        "coordinator_cpu_pct": 100 * cpu / wall,
        "client_cpu_pct": 100 * own / wall,
        "client_loop_lag_ms": {
            "p99": 1000 * lag[int(0.99 * (len(lag) - 1))] if lag else 0.0,
            "max": 1000 * lag[-1] if lag else 0.0,
        },
        "round_long_poll": rec.round_long_poll,
        "unfinished_nodes": len(unfinished),
        "load_average_1m_end": os.getloadavg()[0],
        "cpu_pressure_end": _pressure(),
    }


def verdict(result: dict[str, Any]) -> dict[str, bool]:
    """Whether each target of benchmark 4 is met."""
    lat = result["latency"]
    worst = [r["last_submit_to_all_manifests_s"] for r in result["rounds"]]
    return {
        "heartbeat": lat.get("heartbeat", {}).get("p99_ms", 1e9) < TARGETS["heartbeat_p99_ms"],
        "submit": lat.get("submit", {}).get("p99_ms", 1e9) < TARGETS["submit_p99_ms"],
        "manifest": all(w is not None and w < TARGETS["manifest_all_s"] for w in worst),
        "errors": not (result["errors"] or result["timed_out"] or result["unfinished_nodes"]),
    }


def run_load(
    nodes: int = 1000, rounds: int = 3, *, train_s: float = 2.0, spread_s: float = 5.0,
    payload_bytes: int = 4096, apply_s: float = 1.0, join_s: float = 20.0,
    timeout_s: float = 900.0,
    root: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Start a store and a coordinator under ``root`` (a temporary folder by default), run
    ``nodes`` simulated nodes through ``rounds`` rounds, stop everything; the measurements."""
    with tempfile.TemporaryDirectory(prefix="bench-coord-") as tmp:
        base = Path(root) if root else Path(tmp)
        tokens = {f"n{i:05d}": secrets.token_urlsafe(18) for i in range(nodes)}
        run = RunConfig(
            name="coordbench", rounds=rounds, min_nodes=nodes,
            timing=Timing(first_round_s=600.0, min_round_s=60.0),
        )  # fmt: skip
        store = EmbeddedStore(base / "store")
        store.start()
        proc = None
        try:
            state = base / "coordinator"
            state.mkdir(parents=True, exist_ok=True)
            config = base / "coordinator.toml"
            config.write_text(coordinator_toml(run, store.endpoint, tokens, state, prefix="bench"))
            proc, url = start_coordinator(config, state, base / "coordinator.log")
            result = uvloop.run(
                drive(
                    url, tokens, rounds, train_s, spread_s, payload_bytes, apply_s, join_s,
                    timeout_s, coordinator_pid=proc.pid,
                )
            )  # fmt: skip
            status = fetch_status(url, rounds=0)
            result["timed_out"] = sum(1 for m in status.members if m.state == MemberState.TIMED_OUT)
        finally:
            if proc is not None:
                proc.stop(timeout=30)
            store.stop()
    result.update(
        nodes=nodes, rounds_asked=rounds, train_s=train_s, spread_s=spread_s,
        payload_bytes=payload_bytes, apply_s=apply_s, join_s=join_s, timeout_s=timeout_s,
        cores=os.cpu_count(),
    )  # fmt: skip
    result["targets_met"] = verdict(result)
    return result


def table(result: dict[str, Any]) -> str:
    """The result as a markdown table (one line per request type) and the round times."""
    lines = ["| request | n | p50 ms | p99 ms | max ms |", "|---|---:|---:|---:|---:|"]
    for name, s in result["latency"].items():
        lines.append(
            f"| {name} | {s['n']} | {s['p50_ms']:.1f} | {s['p99_ms']:.1f} | {s['max_ms']:.1f} |"
        )
    worst = [r["last_submit_to_all_manifests_s"] for r in result["rounds"]]
    lines.append("")
    lines.append(
        f"nodes {result['nodes']}, last submit -> manifest on every node (s, per round):"
        f" {', '.join('-' if w is None else f'{w:.2f}' for w in worst)};"
        f" errors {sum(result['errors'].values())} {result['errors'] or ''};"
        f" timed out {result['timed_out']}; unfinished {result['unfinished_nodes']};"
        f" coordinator CPU {result['coordinator_cpu_pct']:.0f} %;"
        f" client CPU {result['client_cpu_pct']:.0f} %; machine CPU pressure"
        f" {result['cpu_pressure_end']}; client loop lag p99"
        f" {result['client_loop_lag_ms']['p99']:.0f} ms; targets met {result['targets_met']}"
    )
    return "\n".join(lines)


def run(json_out: str | None, **kwargs: Any) -> dict[str, Any]:
    """The CLI's entry: run, print the table, write the JSON."""
    result = run_load(**kwargs)
    print(table(result))
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=2))
    return result
