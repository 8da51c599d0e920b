"""Input hygiene and per-client limits of the coordinator's HTTP API (in-process, real store).

- Every number in a body keeps its JSON type and is finite and in range: ``1e400``, ``NaN``,
  ``Infinity``, ``true`` for a number, ``1.0`` for an integer are refused with 422, and no
  request can make a later one fail: the status and metrics keep answering, restart included,
  even over a stored report that no longer validates.
- An empty body is not a JSON object (400); query parameters outside their declared type and
  range are refused (422), never clamped.
- Failed authentications are rate limited per address, requests per node (429 with
  ``Retry-After``); a body that does not arrive in time is answered 408; a connection that does
  not send a complete request head in time is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import pytest

from coordinator.state.db import Database
from coordinator.state.schema import DB_FILE
from protocol.messages import MAX_OBJECT_BYTES
from protocol.runconfig import RunConfig
from support.api import FP_A, Api, ApiFactory, token

RUN = RunConfig(name="hygiene", rounds=5)


async def raw_call(
    api: Api, method: str, path: str, node: str | None, data: bytes
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if node is not None:
        headers["Authorization"] = f"Bearer {token(node)}"
    resp = await api.client.request(method, path, data=data, headers=headers)
    return resp.status, await resp.json()


async def closed_round_0(make_api: ApiFactory, **fields: Any) -> Api:
    api = await make_api(RUN, **fields)
    assert (await api.call("POST", "/v1/join", "n0", {}))[0] == 200
    assert (await api.contribute("n0", 0, FP_A))["accepted"]
    assert (await api.manifest("n0", 0))[0] == 200
    return api


BAD_REPORTS = {
    "loss 1e400": '{"fingerprint": "%s", "train_loss": 1e400}',
    "loss NaN": '{"fingerprint": "%s", "eval_loss": NaN}',
    "loss Infinity": '{"fingerprint": "%s", "train_loss": Infinity}',
    "loss -Infinity": '{"fingerprint": "%s", "train_loss": -Infinity}',
    "loss true": '{"fingerprint": "%s", "train_loss": true}',
    "loss string": '{"fingerprint": "%s", "train_loss": "1.5"}',
    "loss negative": '{"fingerprint": "%s", "train_loss": -1}',
    "loss huge": '{"fingerprint": "%s", "train_loss": 2e6}',
    "timing NaN": '{"fingerprint": "%s", "timings": {"train": NaN}}',
    "timing bad name": '{"fingerprint": "%s", "timings": {"a b": 1}}',
    "mass Infinity": '{"fingerprint": "%s", "mass": '
    '{"computed": Infinity, "sent": 0, "held": 0, "scale": 1}}',
    "bytes float": '{"fingerprint": "%s", "bytes_up": 1.0}',
    "bytes true": '{"fingerprint": "%s", "bytes_down": true}',
    "retries huge": '{"fingerprint": "%s", "retries": 100000000000000000000}',
}


@pytest.mark.asyncio
async def test_bad_numbers_are_refused_and_break_nothing(make_api: ApiFactory) -> None:
    api = await closed_round_0(make_api)
    for why, template in BAD_REPORTS.items():
        status, err = await raw_call(
            api, "POST", "/v1/rounds/0/report", "n0", (template % FP_A).encode()
        )
        assert (status, err["error"]) == (422, "invalid"), (why, err)
    many = {f"p{i}": 1.0 for i in range(40)}
    status, err = await api.call(
        "POST", "/v1/rounds/0/report", "n0", {"fingerprint": FP_A, "timings": many}
    )
    assert (status, err["field"]) == (422, "timings")
    for size in (MAX_OBJECT_BYTES + 1, True, 10.0, "10"):
        status, err = await api.call(
            "POST", "/v1/rounds/1/upload", "n0", {"size": size, "sha256": "0" * 64}
        )
        assert (status, err["field"]) == (422, "size"), size
    status, ack = await api.call(
        "POST", "/v1/rounds/0/report", "n0", {"fingerprint": FP_A, "train_loss": 2.5}
    )
    assert status == 200, ack
    assert (await api.call("GET", "/v1/status", None))[0] == 200
    assert (await api.call("GET", "/metrics", None))[0] == 200


@pytest.mark.asyncio
async def test_a_stored_report_that_no_longer_validates_never_fails_the_status(
    make_api: ApiFactory, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    api = await closed_round_0(make_api)
    assert (await api.call("POST", "/v1/rounds/0/report", "n0", {"fingerprint": FP_A}))[0] == 200
    # What the old coordinator stored for a report with an infinite mass: JSON null.
    stale = {
        "fingerprint": FP_A,
        "mass": {"computed": None, "sent": 0.0, "held": 0.0, "scale": 1.0},
    }
    db = api.coord.machine.db
    with db.tx():
        db.execute("UPDATE reports SET report=? WHERE round=0", (json.dumps(stale),))
    with caplog.at_level(logging.WARNING, "sparseloco.coordinator.status"):
        for _ in range(3):
            status, st = await api.call("GET", "/v1/status", None)
            assert status == 200 and st["rounds"][0]["reports"] == {}
    assert sum("event=report_unreadable" in r.message for r in caplog.records) == 1
    await api.client.close()
    again = await make_api(RUN, prefix=api.config.storage.prefix)  # a restart on that state
    assert (await again.call("GET", "/v1/status", None))[0] == 200
    assert (await again.call("GET", "/metrics", None))[0] == 200
    Database(tmp_path / "state" / DB_FILE).close()


@pytest.mark.asyncio
async def test_empty_bodies_and_out_of_range_queries_are_refused(make_api: ApiFactory) -> None:
    api = await make_api(RUN)
    for data in (b"", b"  "):
        status, err = await raw_call(api, "POST", "/v1/join", "n0", data)
        assert (status, err["error"]) == (400, "bad_json"), data
    for data in (b"[]", b"null", b"1"):
        status, err = await raw_call(api, "POST", "/v1/join", "n0", data)
        assert status == 422, (data, err)
    assert (await api.call("POST", "/v1/join", "n0", {}))[0] == 200
    for query in ("wait=1e9", "wait=-1", "wait=nan", "wait=inf", "wait=1_0", "wait=x"):
        status, err = await api.call("GET", f"/v1/rounds/0/manifest?{query}", "n0")
        assert (status, err["field"]) == (422, "wait"), query
    assert (await api.call("GET", "/v1/rounds/0/manifest?wait=1e-05", "n0"))[0] == 202
    for query in ("rounds=5000", "rounds=1.5", "rounds=-3", "rounds=1e2", "rounds=007"):
        status, err = await api.call("GET", f"/v1/status?{query}", None)
        assert (status, err["field"]) == (422, "rounds"), query
    assert (await api.call("GET", "/v1/status?rounds=1000", None))[0] == 200


@pytest.mark.asyncio
async def test_failed_authentication_is_rate_limited_per_address(
    make_api: ApiFactory, caplog: pytest.LogCaptureFixture
) -> None:
    api = await make_api(RUN, auth_failures_burst=3, auth_failures_per_s=0.5)
    bad = {"Authorization": "Bearer not-a-token-of-this-run"}
    for _ in range(3):
        assert (await api.client.post("/v1/heartbeat", headers=bad)).status == 401
    with caplog.at_level(logging.WARNING, "sparseloco.coordinator.limits"):
        for headers in (bad, {}, {"Authorization": f"Bearer {token('n0')}"}):
            resp = await api.client.post("/v1/join", json={}, headers=headers)
            body = await resp.json()
            assert (resp.status, body["error"]) == (429, "rate_limited")
            assert 1 <= int(resp.headers["Retry-After"]) <= 2
    assert sum("event=rate_limited kind=auth" in r.message for r in caplog.records) == 1
    # The status is not behind a token: still served.
    assert (await api.call("GET", "/v1/status", None))[0] == 200


@pytest.mark.asyncio
async def test_requests_are_rate_limited_per_node(make_api: ApiFactory) -> None:
    api = await make_api(RUN, node_requests_burst=5, node_requests_per_s=0.1)
    assert (await api.call("POST", "/v1/join", "n0", {}))[0] == 200
    codes = [(await api.call("POST", "/v1/heartbeat", "n0"))[0] for _ in range(6)]
    assert codes == [200, 200, 200, 200, 429, 429]
    resp = await api.client.post(
        "/v1/heartbeat", headers={"Authorization": f"Bearer {token('n0')}"}
    )
    assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
    assert (await api.call("POST", "/v1/join", "n1", {}))[0] == 200  # another node is not held


async def send(api: Api, head: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    server = api.client.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(head)
    await writer.drain()
    return reader, writer


@pytest.mark.asyncio
async def test_a_body_that_does_not_arrive_is_answered_408(make_api: ApiFactory) -> None:
    api = await make_api(RUN, body_timeout_s=0.3)
    head = (
        "POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {token('n0')}\r\nContent-Length: 20\r\n\r\n{{"
    ).encode()
    reader, writer = await send(api, head)
    t0 = time.monotonic()
    answer = await asyncio.wait_for(reader.read(4096), 10)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert 0.25 < time.monotonic() - t0 < 5
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


@pytest.mark.asyncio
async def test_a_slow_request_head_is_cut_off(make_api: ApiFactory) -> None:
    api = await make_api(RUN, idle_timeout_s=0.5)
    reader, writer = await send(api, b"GET /v1/status HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    closed = False
    while time.monotonic() - t0 < 10:  # one header byte every 0.1 s never completes the head
        writer.write(b"X")
        await writer.drain()
        try:
            data = await asyncio.wait_for(reader.read(1), 0.1)
        except TimeoutError:
            continue
        except ConnectionError:
            data = b""
        if data == b"":
            closed = True
            break
    assert closed and 0.4 < time.monotonic() - t0 < 3
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    assert (await api.call("GET", "/v1/status", None))[0] == 200  # a prompt client is served
